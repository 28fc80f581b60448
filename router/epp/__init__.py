"""`tandem epp` and `tandem sidecar`: Tandem behind a Kubernetes Gateway, as the Gateway API inference extension's
endpoint picker (docs/gateway.md).

    config.py      EppConfig: the flags of `tandem epp` (the router's, where they mean the same)
    picker.py      Picker: the router's workers, health, KV feeds, load and placement: one endpoint (and a prefill)
    ext_proc.py    ExtProc: Envoy's ext_proc stream, read as the endpoint-picker protocol, answered with the pick
    serve.py       the gRPC server (ext_proc + gRPC health) and the HTTP port (/health, /readiness, /metrics)
    sidecar.py     the pair sidecar on a decode pod: runs the PD exchange with the prefill x-prefiller-host-port names

The room composes the router's own parts (router/workers.py, router/discovery.py, router/placement/,
router/dispatch.py); it adds none of placement's logic.
"""
