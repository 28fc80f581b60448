"""One word per thing (docs/architecture.md's glossary): a machine of a TP group is a node (SGLang's --nnodes),
never a host (host memory's word); torch's TCPStore is the rendezvous store, never "the store" (the KV
store's word); the config has one prefix for PD settings and one name for the role-switch timeout."""

from __future__ import annotations

import re
from pathlib import Path

from common.config import ServerConfig
from router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
# where a TP group's machines and its rendezvous are spoken of
NODE_TEXTS = [*sorted((ROOT / "common/ranks").glob("*.py")), ROOT / "common/parallel/group.py"]
NODE_TEXTS += [ROOT / "docs/tensor-parallel.md", ROOT / "tandem/server.py"]
MACHINE_AS_HOST = re.compile(r"\bhosts\b|\bhost (0|1|k|K)\b|\bhost\d|\bhost_?board\b|\bremote_hosts\b", re.I)
BARE_STORE = re.compile(r"\b(the|a|its|0's) store\b", re.I)


def test_a_machine_of_a_tp_group_is_a_node_and_its_store_the_rendezvous_store():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in NODE_TEXTS
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if MACHINE_AS_HOST.search(line) or BARE_STORE.search(line)
    ]
    assert found == []


def test_pd_settings_have_one_prefix_and_the_role_switch_timeout_one_name():
    fields = set(ServerConfig.model_fields) | set(RouterConfig.model_fields)
    assert not [f for f in fields if f.startswith("disagg_")]  # SGLang's prefix: disaggregation_
    assert "disaggregation_mode" in ServerConfig.model_fields
    timeouts = sorted(f for f in fields if "role_switch" in f and f.endswith("_s"))
    assert timeouts == ["pd_role_switch_timeout_s"]
    assert (
        "pd_role_switch_timeout_s" in ServerConfig.model_fields
        and "pd_role_switch_timeout_s" in RouterConfig.model_fields
    )
