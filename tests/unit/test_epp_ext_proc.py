"""The endpoint picker's ext_proc answers (router/epp/ext_proc.py) over a Picker of two servers, no process: the
pick in the header and in the envoy.lb metadata, the gateway's subset honoured, a 503 when nothing can serve, a body
sent in parts picked once whole; and the pair sidecar's placement (router/epp/sidecar.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from common.wire.errors import InvalidRequest
from router.epp.config import EppConfig
from router.epp.ext_proc import DESTINATION, PREFILLER, ExtProc, subset_of
from router.epp.picker import Picker
from router.epp.sidecar import PrefillerPlacer
from router.request_hints import RequestHints
from router.workers import WorkerRegistry

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def picker(*healthy: str, **config) -> Picker:
    p = Picker(EppConfig(**({"worker": [A, B], "policy": "round_robin"} | config)))
    for url in healthy:
        p.workers.workers[url].healthy = True
    return p


def headers_msg(end: bool, subset: list[str] | None = None) -> pb.ProcessingRequest:
    metadata = Metadata()
    if subset is not None:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    hm = HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/generate")])
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end), metadata_context=metadata
    )


def body_msg(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def answers(p: Picker, *requests: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    async def stream():
        for r in requests:
            yield r

    async def run():
        return [a async for a in ExtProc(p).Process(stream(), None)]

    return asyncio.run(run())


def destination(answer: pb.ProcessingResponse, phase: str = "request_body") -> tuple[dict[str, str], list[str], str]:
    mutation = getattr(answer, phase).response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return (
        headers,
        list(mutation.remove_headers),
        answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value,
    )


def test_the_pick_is_in_the_header_and_the_metadata_and_the_policy_turns():
    p = picker(A, B)
    body = json.dumps({"input_ids": [1, 2, 3]}).encode()
    picks = []
    for _ in range(2):
        first, second = answers(p, headers_msg(False), body_msg(body))
        assert first.WhichOneof("response") == "request_headers"
        headers, removed, meta = destination(second)
        assert headers[DESTINATION] == meta and removed == [PREFILLER]
        assert second.request_body.response.clear_route_cache
        picks.append(meta)
    assert sorted(picks) == ["10.0.0.1:8000", "10.0.0.2:8000"]  # round robin over both
    assert [w.in_flight for w in p.workers.workers.values()] == [0, 0]  # each stream's end released its pick


def test_a_pick_counts_in_flight_until_released():
    p = picker(A, B, policy="power_of_two")
    first = p.pick({})
    assert [w.in_flight for w in first.workers] == [1]
    second = p.pick({})  # power_of_two: the idle one
    assert {first.endpoint, second.endpoint} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    p.release(first), p.release(second)
    assert [w.in_flight for w in p.workers.workers.values()] == [0, 0]


def test_the_subset_is_honoured_and_an_empty_choice_is_a_503():
    p = picker(A, B)
    for _ in range(3):
        (answer,) = answers(p, headers_msg(True, ["10.0.0.2:8000"]))
        assert destination(answer, "request_headers")[2] == "10.0.0.2:8000"
    p.workers.workers[B].healthy = False
    (answer,) = answers(p, headers_msg(True, ["10.0.0.2:8000"]))
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["type"] == "overloaded_error"


def test_a_body_in_parts_is_picked_once_whole_and_bad_json_by_load():
    p = picker(A)
    replies = answers(p, headers_msg(False), body_msg(b'{"input_', end=False), body_msg(b"not json"))
    assert replies[1].request_body.response.header_mutation.set_headers == []
    assert destination(replies[2])[2] == "10.0.0.1:8000"


def test_subset_as_one_string_of_endpoints():
    metadata = Metadata()
    hint = Struct()
    hint.update({"x-gateway-destination-endpoint-subset": "10.0.0.1:8000, 10.0.0.2:8000"})
    metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    assert subset_of(metadata) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert subset_of(Metadata()) is None


def test_pd_names_the_prefill():
    p = picker(
        "http://p:8000",
        "http://d:8000",
        worker=[],
        prefill=[{"url": "http://p:8000", "bootstrap_port": 8998}],
        decode=["http://d:8000"],
    )
    (answer,) = answers(p, headers_msg(True))
    headers, removed, meta = destination(answer, "request_headers")
    assert (meta, headers[PREFILLER], removed) == ("d:8000", "p:8000", [])


def test_the_sidecar_pairs_its_decode_with_the_named_prefill_or_computes_alone():
    workers = WorkerRegistry(2)
    decode, prefill = workers.add("http://d:1", "decode"), workers.add("http://p:2", "prefill", 8998)
    decode.healthy = prefill.healthy = True
    placer = PrefillerPlacer(workers, decode)
    named = RequestHints(prefiller="p:2")
    assert placer.pick({}, (), named).prefill is prefill
    assert placer.pick({}, {"http://p:2"}, named).path == "local"  # a retry avoids the prefill that failed
    assert placer.pick({}, (), RequestHints()).prefill is None
    decode.healthy = False
    assert placer.pick({}, (), named) is None


def test_a_bad_prefiller_header_is_a_400_naming_it():
    with pytest.raises(InvalidRequest) as e:
        RequestHints.from_headers({"x-prefiller-host-port": "http://p/x"})
    assert e.value.param == "x-prefiller-host-port"
    assert RequestHints.from_headers({"x-prefiller-host-port": "10.1.2.3:8000"}).prefiller == "10.1.2.3:8000"


def test_epp_start_up_mistakes_are_one_line():
    from tandem.cli import main

    for argv, said in (
        (["epp"], "give the pool: --worker URL"),
        (["epp", "--worker", "http://a:1", "--decode", "http://b:2"], "not both"),
        (["epp", "--worker", "http://a:1", "--grpc-port", "0"], "--grpc-port 0:"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert str(e.value).startswith("tandem epp: ") and said in str(e.value) and "\n" not in str(e.value)


def test_the_sidecar_asks_the_api_key_and_answers_503_without_its_decode():
    from aiohttp.test_utils import TestClient, TestServer

    from router.config import RouterConfig
    from router.epp.sidecar import create_sidecar_app

    async def run() -> tuple[int, int, str]:
        app = create_sidecar_app(RouterConfig(decode=["http://127.0.0.1:9"], api_key="k", migration_limit=0))
        async with TestClient(TestServer(app)) as client:
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            refused = await client.post("/generate", json=body)
            down = await client.post("/generate", json=body, headers={"Authorization": "Bearer k"})
            return refused.status, down.status, (await down.json())["error"]["type"]

    assert asyncio.run(run()) == (401, 503, "overloaded_error")
