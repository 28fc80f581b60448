"""Custom resources the chart makes (the inference extension's InferencePool, Gateway API's HTTPRoute), validated
as kubernetes-validate validates the built-in kinds, strictly: against the OpenAPI schema of their CRD, shipped in
tests/helm/schemas/ (the `openAPIV3Schema` of one served version, descriptions left out), with every object that
lists its properties closed to others (what `kubectl apply --validate=strict` refuses), and their metadata against
Kubernetes' ObjectMeta. The CEL rules (`x-kubernetes-validations`) are kept in the schemas but not evaluated: the
tests assert what those rules ask of the chart's objects.

A schema is written from the upstream CRD by `python -m tests.helm.crd CRD.yaml VERSION OUT.json`:
  InferencePool v1: kubernetes-sigs/gateway-api-inference-extension v1.6.0,
    config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
  HTTPRoute v1: kubernetes-sigs/gateway-api v1.6.1, config/crd/standard/gateway.networking.k8s.io_httproutes.yaml
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes_validate import validate
from kubernetes_validate.utils import latest_version

SCHEMAS = Path(__file__).parent / "schemas"
KINDS = {  # (apiVersion, kind) -> its schema file
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway.networking.k8s.io-v1.json",
}
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor"}


def strict(schema: Any) -> Any:
    """`schema` with every object that names its properties (and allows no others or unknown fields) closed."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def validator(name: str) -> jsonschema.Draft7Validator:
    schema = strict(json.loads((SCHEMAS / name).read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate_custom(doc: dict) -> None:
    """Raises jsonschema.ValidationError (naming the field) when `doc` is not a valid object of its CRD."""
    validator(KINDS[(doc["apiVersion"], doc["kind"])]).validate(doc)
    validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, latest_version(), strict=True)


def validate_objects(docs: list[dict]) -> None:
    """Every rendered object valid: the built-in kinds by kubernetes-validate (strict), the custom kinds above by
    their CRD, a LeaderWorkerSet's two pod templates as PodTemplates; the Prometheus Operator's monitors are left
    out (no schema shipped)."""
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in KINDS:
            validate_custom(doc)
        elif doc["kind"] == "LeaderWorkerSet":
            for node in ("leader", "worker"):
                template = doc["spec"]["leaderWorkerTemplate"][f"{node}Template"]
                pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": node}, "template": template}
                validate(pod, latest_version(), strict=True)
        elif doc["kind"] not in MONITOR_KINDS:
            validate(doc, latest_version(), strict=True)  # raises, naming the field, on anything invalid


def schema_from_crd(crd: dict, version: str) -> dict:
    """The openAPIV3Schema of `version` in a CRD, its descriptions left out."""
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return drop_descriptions(copy.deepcopy(served["schema"]["openAPIV3Schema"]))


def drop_descriptions(schema: Any) -> Any:
    if isinstance(schema, list):
        return [drop_descriptions(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    # a property named "description" is a schema (a dict), kept; a schema's own description is a string
    return {k: drop_descriptions(v) for k, v in schema.items() if not (k == "description" and isinstance(v, str))}


if __name__ == "__main__":
    crd_file, version, out = sys.argv[1:4]
    schema = schema_from_crd(yaml.safe_load(Path(crd_file).read_text()), version)
    Path(out).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
