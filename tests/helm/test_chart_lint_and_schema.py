"""`helm lint` of the default values and every example, and the values schema turning wrong values
away with a message that names the key."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import CHART, EXAMPLES, example, render

KUBE_VERSION = "v1.35.0"


@pytest.mark.parametrize("values_file", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults")
def test_lint_passes_strict(values_file):
    values = example(values_file.name) if values_file else None
    report = helm_python.lint(CHART, values, strict=True, kube_version=KUBE_VERSION)
    assert report["errors"] == [] and report["total_charts_linted"] == 1
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # no warning either


@pytest.mark.parametrize(
    "values, where, says",
    [
        ({"prefill": {"replicas": -1}}, "/prefill/replicas", "minimum: got -1, want 0"),
        ({"decode": {"replicas": -2}}, "/decode/replicas", "minimum: got -2, want 0"),
        ({"decode": {"tpSize": 0}}, "/decode/tpSize", "minimum: got 0, want 1"),
        ({"transfer": {"backend": "gloo"}}, "/transfer/backend", "value must be one of 'mooncake', 'nixl'"),
        ({"transfer": {"protocol": "rdma"}}, "/transfer/rdma/devices", "minItems: got 0, want 1"),
        ({"model": {"source": "hf"}}, "/model/hf", "missing property 'id'"),
        ({"model": {"source": "pvc"}}, "/model/pvc", "missing property 'claimName'"),
        ({"model": {"source": "hostPath"}}, "/model/hostPath", "missing property 'path'"),
        ({"model": {"source": "s3"}}, "/model/source", "value must be one of 'builtin', 'pvc', 'hostPath', 'hf'"),
        ({"model": {"source": None}}, "/model", "missing property 'source'"),
        ({"router": {"policy": "fastest"}}, "/router/policy", "value must be one of"),
        ({"prefil": {"replicas": 2}}, "", "additional properties 'prefil' not allowed"),
    ],
)
def test_the_schema_rejects_wrong_values_naming_the_key(values, where, says):
    with pytest.raises(helm_python.HelmValuesError) as e:
        render(values)
    assert f"at '{where}': " in str(e.value) and says in str(e.value), str(e.value)
