"""Who may do what in a public run, and how a lie is caught: operator certificates and
admission (`admission`), the run's signed manifest (`manifest`), what the DHT stores
(`record_rules`), who may synchronize as one peer sees it (`entitlement`), and the
recomputation of a committed merge with fraud notices (`audit`)."""
