"""Evidence: OpenLineage events (:mod:`.lineage`) and the local event log
(:mod:`.lineage_log`); reconcile (:mod:`.reconcile`) and its pure classification
(:mod:`.findings`).
"""
