"""How the planner makes a decision happen (--actuator):

flip    the router's POST /pd_role_switch (router/role_switch.py) on the least busy server of the role that
        gives one up; a server that cannot switch (no --enable-pd-role-switch) is not asked again
scale   the prefill and decode Deployments' replicas, through the Kubernetes API's scale subresource with the
        pod's service account (the Helm chart's planner Role grants get/patch on deployments/scale); the
        Deployments' own replicas are the current counts
"""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp

from planner.config import PlannerConfig
from planner.decide import Decision
from planner.observe import Observation

log = logging.getLogger("tandem.planner")
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API = "https://kubernetes.default.svc"


class Flip:
    def __init__(self, config: PlannerConfig, headers: dict[str, str] | None = None):
        self.router, self.headers = config.router.rstrip("/"), headers
        self.timeout = aiohttp.ClientTimeout(total=None)  # the router bounds the switch (--pd-role-switch-timeout-s)
        self.refused: set[str] = set()  # servers that cannot switch

    async def apply(self, session: aiohttp.ClientSession, decision: Decision, obs: Observation) -> str:
        """What happened, for the log and the decision's metric."""
        donor = "decode" if decision.action == "to_prefill" else "prefill"
        new_role = "prefill" if donor == "decode" else "decode"
        candidates = sorted(
            (w for w in obs.workers if w.role == donor and w.url not in self.refused), key=lambda w: w.in_flight
        )
        if not candidates:
            return f"no {donor} server can switch"
        worker = candidates[0]
        body = {"url": worker.url, "new_role": new_role}
        async with session.post(
            self.router + "/pd_role_switch", json=body, headers=self.headers, timeout=self.timeout
        ) as r:
            answer = await r.text()
            if r.status == 400:
                self.refused.add(worker.url)
            if r.status != 200:
                return f"{worker.url} did not switch to {new_role}: HTTP {r.status} {answer[:200]}"
        return f"{worker.url} switched {donor} -> {new_role}"


class Scale:
    def __init__(self, config: PlannerConfig, root: Path = SERVICE_ACCOUNT, api: str = API):
        self.config, self.root, self.api = config, root, api
        self.namespace = config.namespace or _file_text(root / "namespace") or "default"

    def _url(self, deployment: str) -> str:
        return f"{self.api}/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}/scale"

    def _auth(self) -> dict[str, str]:
        token = _file_text(self.root / "token")  # read each time: the kubelet rotates it
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ssl(self) -> object:
        """The cluster's CA (the service account's), for every call to the API server."""
        ca = self.root / "ca.crt"
        if ca.is_file():
            import ssl

            return ssl.create_default_context(cafile=str(ca))
        return None

    async def replicas(self, session: aiohttp.ClientSession) -> tuple[int, int]:
        """The Deployments' replicas (spec): the counts a decision starts from."""
        out = []
        for name in (self.config.prefill_deployment, self.config.decode_deployment):
            async with session.get(self._url(name), headers=self._auth(), ssl=self.ssl()) as r:
                r.raise_for_status()
                out.append(int((await r.json())["spec"].get("replicas", 0)))
        return out[0], out[1]

    async def apply(self, session: aiohttp.ClientSession, decision: Decision, obs: Observation) -> str:
        done = []
        for name, want, have in (
            (self.config.prefill_deployment, decision.prefill, obs.prefill),
            (self.config.decode_deployment, decision.decode, obs.decode),
        ):
            if want == have:
                continue
            headers = {**self._auth(), "Content-Type": "application/merge-patch+json"}
            async with session.patch(
                self._url(name), json={"spec": {"replicas": want}}, headers=headers, ssl=self.ssl()
            ) as r:
                if r.status != 200:
                    return f"scaling {name} to {want} failed: HTTP {r.status} {(await r.text())[:200]}"
            done.append(f"{name} {have} -> {want}")
        return "scaled " + ", ".join(done)


def _file_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
