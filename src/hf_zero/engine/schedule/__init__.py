"""When the shards move: the units a model is cut into (``unit``), the protocol that gathers,
frees and reduces them around each unit's forward and backward (``hooks``), the reduction buckets
(``buckets``), the ranks' agreement on the order (``rank_agreement``), compiled unit forwards
(``compiled_units``) and the per-phase timers (``timers``)."""
