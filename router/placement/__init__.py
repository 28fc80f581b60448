"""The router's placement room: everything that decides which pair (or decode alone) serves a request.

    placer.py        Placer.pick: the candidates, --pd-placement's rule, the pair policy, the metric
    rules.py         the rules of --pd-placement: remote, two_way, cost
    cost.py          cost's model of one option (a pair, or a decode alone) from measured rates
    policies.py      the policies of one side (--policy, --decode-policy) and their names
    kv_policy.py     kv_aware: what each worker's cache holds of a prompt, priced in tokens
    kv_index.py      the router's index of the workers' cached blocks
    kv_feeds.py      the workers' KV event streams that fill the index
    worker_stats.py  the workers' /metrics, scraped: the rates cost reads

The room reads the workers (router.workers), counts into router.metrics and returns a router.pair_call.Pair;
it imports nothing else of the router (tests/unit/test_import_rules.py).
"""
