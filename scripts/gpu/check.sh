#!/usr/bin/env bash
# Tandem's one-command GPU check (scripts/gpu/README.md; never run on a GPU yet). Four modes, one file:
#
#   bash scripts/gpu/check.sh prep           # on a CPU machine, repo root: fills the ignored .gpu/ (33.3 MiB)
#   bash scripts/gpu/check.sh prep-kernels   # then, with nvcc 13: FlashInfer's 4 modules, .gpu/kernels/ (3.3 MiB, ~13 min)
#   bash scripts/gpu/check.sh                # on the GPU machine (carry .gpu/): one command of at most 9 minutes
#   TANDEM_GPU_CHECK_FAKES=DIR ...           # no GPU: the control flow and summary on canned results (tests/unit/test_gpu_check.py)
#
# Assumes on the GPU machine what scripts/gpu/image-modules.txt lists (python3 3.12 with torch 2.11+ for CUDA 13,
# transformers, numpy, triton, ...), nvcc 13.0, ninja, gcc; no network; one H100/H200.
# .gpu/site.tar.xz = pip-less site dir built by `prep`: flashinfer-python 0.7.2.post1 trimmed to the attention JIT
# sources, apache-tvm-ffi 0.1.15.post2, xgrammar 0.2.8 (the grammar backend: an Engine imports it), nixl 1.5.1 +
# nixl-cu13 1.5.1 (UCX plugin only), mooncake-transfer-engine-cuda13 0.3.14 (engine.so only), pydantic(-core,
# -settings), fastapi, starlette, uvicorn, pyzmq, httptools, python-dotenv, annotated-types, typing-inspection,
# sniffio, typing-extensions, gguf 0.19.0 (GGUF reading: an Engine imports it lazily). .gpu/kernels/<module>.so.xz
# = prep-kernels' builds (scripts/gpu/kernels.py), one file per module: unpacked where FlashInfer loads
# ahead-of-time modules; FlashInfer JIT-builds only one that is missing or fails to load.
# FlashInfer's wrappers are pinned to fa2 (--flashinfer-backend): four modules (the paged prefill at head_dim
# 128, whose kernels also run the tensor-core decode, and at 64; the decode at 64; sampling).
# Deselected: the float16 parity params (2 more JIT modules). Writes at most 7 files to $OUT; summary.txt and
# results.json are rewritten after every step (a run cut at the limit keeps what passed), printed last.
# Order: unpack, probe, the kernels loaded (or built) in the background, the models generated, the transfer
# tests; once no nvcc runs, the transfer benchmark (its ratios); the GPU correctness steps (CHECKS, one line
# each: FlashInfer attention and sampling, CUDA graphs, parity, the FP8 block GEMM, deterministic inference), bf16 parity vs transformers (graphs on), the
# decode roofline with and without graphs (and their greedy tokens compared), PD TTFT; each step time-boxed,
# the whole run stops starting steps at DEADLINE seconds (default 540).
set -o pipefail
ROOT=$(pwd); [ -f "$ROOT/pyproject.toml" ] || ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT" || exit 1

if [ "${1:-}" = prep ]; then  # ---------------------------------------------------------------- CPU machine
  set -eu
  S=/tmp/tandem-gpu-stage; WH=/tmp/tandem-gpu-wheels; rm -rf "$S" "$WH"; mkdir -p "$S" "$WH" .gpu
  DL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$WH")
  for n in 5 17 24 26 27 28 31 34 35; do DL+=(--platform "manylinux_2_${n}_x86_64"); done
  "${DL[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 flashinfer-python==0.7.2.post1 \
    apache-tvm-ffi==0.1.15.post2 nixl==1.5.1 nixl-cu13==1.5.1 mooncake-transfer-engine-cuda13==0.3.14 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    pyzmq==27.3.0 httptools==0.9.0 sniffio==1.3.1 typing-extensions==4.16.0 xgrammar==0.2.8 gguf==0.19.0
  for w in "$WH"/*.whl; do python3 -m zipfile -e "$w" "$S"; done
  cd "$S"
  rm -rf ./*.data nixl_ep nixl_ep_cu13 nixl_cu13.scripts flashinfer/moe_ep .nixl_cu13.mesonpy.libs/libobj_utils.so
  find flashinfer/data/csrc -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +   # top-level .cu/.jinja/.h stay
  (cd flashinfer/data/cutlass && rm -rf examples test python docs media && find tools -mindepth 1 -maxdepth 1 ! -name util -exec rm -rf {} +)
  (cd flashinfer/data/cccl && rm -rf benchmarks ci cudax docs python c examples test && find libcudacxx -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +)
  (cd flashinfer/data/spdlog && find . -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +)
  for d in .nixl_cu13.mesonpy.libs/plugins nixl_cu13.libs/nixl; do
    (cd "$d" && rm -f libplugin_{AZURE_BLOB,GDS,GDS_MT,GPUNETIO,GUSLI,INFINIA,LIBFABRIC,OBJ,POSIX}.so libtelemetry_exporter_doca.so); done
  (cd nixl_cu13.libs && rm -f libaws* libazure* libs2n* libgusli* libxml2* libaio* liburing* ucx/libucx_perftest*)
  (cd mooncake && rm -rf _store*.so mooncake_client mooncake_master libmooncake_pg*.so _ep*.so libmooncake_ep_device.so \
     transfer_engine_bench reshard mooncake_ep_jit _pg_jit store nvlink_allocator.so _fast_copy*.so)
  (cd mooncake_transfer_engine_cuda13.libs && rm -f libetcd_wrapper-*.so libcrypto-* libzmq-* libpgm-* libsodium-* liburing-* libxxhash-* libzstd-*)
  cd "$ROOT"; tar -C "$S" -cf - . | xz -6 -T2 > .gpu/site.tar.xz
  du -h .gpu/*; echo "device run: command 'bash ${0#./}', carry [\".gpu\"], timeout_s 600"; exit 0
fi

if [ "${1:-}" = prep-kernels ]; then  # --------------------------------------------------- CPU machine, after prep
  # FlashInfer's modules built here with nvcc 13 for sm_90a (scripts/gpu/kernels.py), one .gpu/kernels/<name>.so.xz
  # each. Measured here (one nvcc at a time, niced, 2 shared cores at load 4-8): decode64 74 s, sampling 194 s,
  # prefill64 210 s, prefill128 317 s, 13 min in all; 3.3 MiB packed. docs/performance.md.
  set -eu
  K=${KERNEL_BUILD:-/tmp/tandem-gpu-kernels}; PY=${PYTHON:-$ROOT/.venv/bin/python}; mkdir -p "$K/site" "$K/dl" "$K/stubs" .gpu/kernels
  [ -x "${CUDA_HOME:=/usr/local/cuda}/bin/nvcc" ] || { echo "prep-kernels: no nvcc in CUDA_HOME=$CUDA_HOME"; exit 1; }
  if [ ! "$K/site/.from" -nt .gpu/site.tar.xz ]; then  # the bundle's own FlashInfer sources (again after a new prep)
    rm -rf "$K/site/flashinfer"; tar -xJf .gpu/site.tar.xz -C "$K/site" ./flashinfer; touch "$K/site/.from"; fi
  # what importing flashinfer needs beyond the project's venv, and cuRAND's headers (the sampler includes them)
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$K/dl" nvidia-ml-py==13.615.71 einops==0.8.2 \
    tabulate==0.10.0 nvidia-curand==10.4.0.35
  for w in "$K"/dl/*.whl; do python3 -m zipfile -e "$w" "$K/site"; done
  [ -f "$K/stubs/libcuda.so.1" ] || for flags in "" -D__CUDA_API_VERSION_INTERNAL -DCUDA_API_PER_THREAD_DEFAULT_STREAM; do
    gcc -E -P $flags -x c "$CUDA_HOME/include/cuda.h"  # the driver's functions: a link-time stub (docker/cuda_home.sh)
  done | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' (' | sort -u | sed 's/.*/void &(void) {}/' \
    | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$K/stubs/libcuda.so.1"
  ln -sf libcuda.so.1 "$K/stubs/libcuda.so"
  export CUDA_HOME FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=$K/ws MAX_JOBS=${MAX_JOBS:-1} \
    PYTHONPATH=$K/site PATH=$CUDA_HOME/bin:$PATH LD_LIBRARY_PATH=$K/stubs:$CUDA_HOME/lib64 \
    FLASHINFER_EXTRA_CUDAFLAGS="-I$K/site/nvidia/cu13/include" FLASHINFER_EXTRA_LDFLAGS="-L$K/stubs"
  nice -n 10 "$PY" scripts/gpu/kernels.py build .gpu/kernels "${@:2}"
  du -ch .gpu/*.xz .gpu/kernels/* | tail -1; exit 0
fi

# ----------------------------------------------------------------------------------------------- device
T0=$SECONDS; DEADLINE=${DEADLINE:-540}; OUT=${OUT:-/tmp/gpu-out}; W=${W:-/tmp/gpuw}
FAKES=${TANDEM_GPU_CHECK_FAKES:-}  # a folder of canned results per step: nothing runs but this script's own flow
mkdir -p "$OUT" "$W/logs/jit"; : > "$W/steps.txt"
left() { echo $(( DEADLINE - (SECONDS - T0) )); }
fake() {  # name cmd...: the command a step would run, then its canned result: FAKES/name/{log,rc,seconds,*.json}
  local d=$FAKES/$1; shift; echo "+ $*"
  [ -f "$d/seconds" ] && sleep "$(cat "$d/seconds")"
  [ -f "$d/log" ] && cat "$d/log"
  for f in "$d"/*.json; do [ -f "$f" ] && cp "$f" "$W/"; done
  return "$(cat "$d/rc" 2>/dev/null || echo 0)"
}
summarize() { python3 "$W/summary.py" "$W" "$OUT" > /dev/null 2>&1; }  # $OUT/summary.txt, results.json: a cut run keeps them
skip() { echo "$1 SKIPPED ($2)" >> "$W/steps.txt"; summarize; }  # name reason
step() {  # name timeout cmd...: runs if time is left, log in $W/logs/name.log, status in steps.txt, then the summary
  local name=$1 to=$2 rem t rc; shift 2; rem=$(left)
  if (( rem < 20 )); then skip "$name" deadline; return 99; fi
  (( to > rem - 10 )) && to=$(( rem - 10 )); t=$SECONDS
  if [ -n "$FAKES" ]; then fake "$name" "$@"; else timeout -k 5 "$to" "$@"; fi > "$W/logs/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc ${to}s-box $((SECONDS - t))s" >> "$W/steps.txt"; tail -3 "$W/logs/$name.log" | sed "s/^/  [$name] /"
  summarize; return $rc
}
http_ok() { python3 -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }
wait_http() { local i; for i in $(seq "$2"); do http_ok "$1" && return 0; kill -0 "$3" 2>/dev/null || return 1; sleep 1; done; return 1; }  # url s pid

export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi FLASHINFER_CUDA_ARCH_LIST=9.0a
if [ -z "$FAKES" ]; then  # ------------------------------------------------------- the stack, unpacked
PYBIN=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
export PATH="$PYBIN:/usr/local/cuda/bin:$PATH"; [ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p /tmp/site /tmp/site/_sys
if [ ! -f /tmp/site/.ok ]; then
  { command -v xz >/dev/null && tar -xJf .gpu/site.tar.xz -C /tmp/site; } ||
    python3 -c "import tarfile; tarfile.open('.gpu/site.tar.xz').extractall('/tmp/site')" || echo "UNPACK FAILED"
  python3 - .gpu/kernels /tmp/site/flashinfer/data/aot <<'EOF'  # prep-kernels' modules, where FlashInfer loads
import lzma, pathlib, sys  # ahead-of-time ones (one that is not there or fails to load: JIT-built, with a warning)
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.so.xz")):
    n = f.name[: -len(".so.xz")]; d = pathlib.Path(sys.argv[2], n); d.mkdir(parents=True, exist_ok=True)
    try: (d / "tmp").write_bytes(lzma.decompress(f.read_bytes())); (d / "tmp").rename(d / f"{n}.so")  # whole or not at all
    except Exception as e: print("kernel not unpacked:", n, repr(e)[:200])
EOF
  touch /tmp/site/.ok
fi
export PYTHONPATH=/tmp/site:$ROOT
for pair in libibverbs.so.1:libibverbs- libmlx5.so.1:libmlx5- libnuma.so.1:libnuma- libcurl.so.4:libcurl-; do  # Mooncake's NEEDED
  so=${pair%%:*}; ldconfig -p | grep -q "[[:space:]]$so " || ln -sf /tmp/site/nixl_cu13.libs/${pair##*:}*.so* "/tmp/site/_sys/$so"
done
CUDART=$(python3 -c "import os,torch; torch.cuda.init(); print(next((os.path.dirname(l.split()[-1]) for l in open('/proc/self/maps') if 'libcudart.so' in l), ''))" 2>/dev/null)
export LD_LIBRARY_PATH=/tmp/site/_sys${CUDART:+:$CUDART}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "setup $((SECONDS - T0))s; cudart dir: ${CUDART:-none}"
fi

# ------------------------------------------------------------------------------- helper programs
cat > "$W/probe.py" <<'EOF'
import importlib, json, subprocess, sys, time, torch
r = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
     "sms": torch.cuda.get_device_properties(0).multi_processor_count, "mem_GiB": torch.cuda.mem_get_info()[1] / 2**30,
     "dlpack_c_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")}
def ms(fn, n=10):
    for _ in range(3): fn()
    s, e, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(n): s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return sorted(t)[n // 2]
dump = lambda: json.dump(r, open(sys.argv[1], "w"), indent=1)  # after each part: a native crash keeps the rest
for mib in (45, 128, 1024):  # 45 MiB: the bench's 2k-prompt case; 128 MiB: its 8B-shaped case (bf16)
    x = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
    r[f"d2d_copy_{mib}MiB_GBps"] = round((mib << 20) / ms(lambda: y.copy_(x)) / 1e6, 1)  # bytes copied per s
r["d2d_rw_GBps"] = 2 * r["d2d_copy_1024MiB_GBps"]  # read + written: the roofline's bandwidth
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a)
r["bf16_mm_TFLOPs"] = round(2 * 8192**3 / ms(lambda: a @ b) / 1e9, 1); dump()
try:
    t = torch.zeros(8, 4, dtype=torch.float8_e4m3fn, device="cuda"); i = torch.tensor([1, 3], device="cuda")
    t[i] = torch.ones(2, 4, device="cuda").to(t.dtype); r["fp8_index"] = float(t[i].float().sum())
except Exception as e: r["fp8_index"] = repr(e)[:200]
for m in ("tvm_ffi", "flashinfer", "xgrammar", "nixl._api", "mooncake.engine", "zmq", "pydantic", "pydantic_settings", "fastapi", "uvicorn", "httptools"):
    try: t0 = time.time(); mod = importlib.import_module(m); r["import " + m] = f"{getattr(mod, '__version__', 'ok')} {time.time() - t0:.1f}s"
    except BaseException as e: r["import " + m] = "FAIL " + repr(e)[:300]
    dump()
for c in ("nvcc --version | grep release", "ninja --version", "gcc --version", "nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader", "nproc", "free -g | grep Mem"):
    try: r[c.split()[0]] = subprocess.run(c, shell=True, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1][:200]
    except Exception as e: r[c.split()[0]] = repr(e)[:100]
dump(); print(json.dumps(r, indent=1))
EOF
cat > "$W/prewarm.py" <<'EOF'
# Builds (or loads) the FlashInfer module Tandem's FlashInferAttention uses for one shape: DTYPE HQ HKV DIM MODE;
# or, with the one argument "sampling", the sampler's top-k / top-p kernels
import sys, time, torch
if sys.argv[1] == "sampling":
    import flashinfer.sampling as fs
    t = time.time(); p = torch.softmax(torch.randn(4, 1000, device="cuda"), -1)
    fs.top_k_renorm_probs(p, torch.full((4,), 5, dtype=torch.int32, device="cuda")); fs.top_p_renorm_probs(p, torch.full((4,), 0.9, device="cuda"))
    torch.cuda.synchronize(); print(f"JIT OK sampling {time.time() - t:.1f}s", flush=True); sys.exit()
from common.attention.flashinfer_backend import FlashInferAttention
from common.core.forward_batch import ForwardBatch, ForwardMode
from common.core.page_meta import build_page_meta
from common.memory.kv_pool import KVPool
dt, (hq, hkv, d), mode = getattr(torch, sys.argv[1]), map(int, sys.argv[2:5]), ForwardMode[sys.argv[5]]
P, seq = 16, 20; n = 20 if mode == ForwardMode.EXTEND else 1
pool = KVPool(1, 8, P, hkv, d, dt, "cuda"); attn = FlashInferAttention(pool, hq, d, d ** -0.5)
table = (torch.arange(1, 3, dtype=torch.int32)[:, None] * P + torch.arange(P, dtype=torch.int32)).reshape(1, -1).cuda()
pages, _ = build_page_meta([seq], [n], P, "cuda", [])
cuda = lambda x: x.to("cuda")
batch = ForwardBatch(mode, cuda(torch.zeros(n, dtype=torch.int64)), cuda(torch.arange(seq - n, seq)), table[0, seq - n:seq].long(),
                     cuda(torch.zeros(1, dtype=torch.int64)), torch.tensor([seq]), torch.tensor([n]), cuda(torch.arange(n)), table, pages, pages.seq_lens)
t = time.time(); attn.init_forward(batch)
q, k, v = (torch.randn(n, h, d, dtype=dt, device="cuda") for h in (hq, hkv, hkv))
out = attn.forward(q, k, v, 0, batch); torch.cuda.synchronize(); assert torch.isfinite(out.float()).all()
print(f"JIT OK {' '.join(sys.argv[1:6])} {time.time() - t:.1f}s prefill_backend={getattr(attn.prefill, '_backend', '?')}", flush=True)
EOF
cat > "$W/gen_model.py" <<'EOF'
# Random-weight Llama in bf16 + a WordLevel tokenizer: SHAPE(smol|8b) OUT LAYERS INIT_STD
import sys, torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
S = {"smol": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
     "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)}
cfg = LlamaConfig(**S[sys.argv[1]], num_hidden_layers=int(sys.argv[3]), initializer_range=float(sys.argv[4]), max_position_embeddings=8192, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
torch.manual_seed(0); torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"): m = LlamaForCausalLM(cfg)
m.save_pretrained(sys.argv[2], max_shard_size="2GB"); V = cfg.vocab_size
PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")), eos_token=f"t{V - 1}").save_pretrained(sys.argv[2])
print("wrote", sys.argv[2], sum(p.numel() for p in m.parameters()) / 1e9, "B params")
EOF
cat > "$W/parity.py" <<'EOF'
# bf16 vs transformers on one random model: teacher-forced logprobs of HF's own continuation (no compounding)
# and greedy tokens (first divergence, top-2 gap there). MODEL OUT.json BACKENDS(comma)
import json, logging, sys, time, traceback, torch
from transformers import AutoModelForCausalLM
from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # the CUDA graphs line
M, NEW = sys.argv[1], 24
g = torch.Generator().manual_seed(1)
P = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 33, 130, 400, 1000)]
hf = AutoModelForCausalLM.from_pretrained(M, dtype=torch.bfloat16).cuda().eval(); ref = []
with torch.inference_mode():
    for p in P:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        lp = torch.log_softmax(hf(out).logits[0].float(), -1)[:-1]
        ref.append(dict(full=out[0].tolist(), gen=out[0, len(p):].tolist(), lp=lp.gather(1, out[0, 1:, None])[:, 0].tolist(), top1=lp.argmax(-1).tolist()))
del hf; torch.cuda.empty_cache(); res = {"prompt_lens": [len(p) for p in P], "new": NEW}
for be in sys.argv[3].split(","):
    t = time.time()
    try:
        eng = Engine(ServerConfig(model=M, device="cuda", dtype="bfloat16", attention_backend=be, page_size=16, chunked_prefill_size=128, max_total_tokens=32768))
        eng.warm_up()  # the decode CUDA graphs (flashinfer)
        tf = [Req(f"tf{i}", r["full"], SamplingParams(max_new_tokens=1, temperature=0), return_logprob=True, top_logprobs_num=1, logprob_start_len=0) for i, r in enumerate(ref)]
        gen = [Req(f"g{i}", p, SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True), return_logprob=True, top_logprobs_num=2) for i, p in enumerate(P)]
        for batch in (tf, gen):
            for r in batch: eng.scheduler.add_request(r)
            while eng.scheduler.step(): pass
        rows = []
        for r, a, b in zip(ref, tf, gen):
            d = [abs(x - y) for x, y in zip(a.input_logprobs[1:], r["lp"]) if x is not None]
            top = [(t[0][0] if t else None) for t in (a.input_top_logprobs or [None])[1:]]
            first = next((i for i, (x, y) in enumerate(zip(b.output_ids, r["gen"])) if x != y), None)
            gap = None if first is None else b.output_top_logprobs[first][0][1] - b.output_top_logprobs[first][1][1]
            rows.append(dict(len=len(r["full"]) - NEW, lp_max=max(d) if d else None, lp_mean=sum(d) / max(1, len(d)), n_lp=len(d),
                             top1_agree=round(sum(x == y for x, y in zip(top, r["top1"])) / max(1, len(top)), 4),
                             greedy_full=first is None, first_diff=first, top2_gap=gap))
        res[be] = dict(rows=rows, s=round(time.time() - t, 1)); del eng; torch.cuda.empty_cache()
    except Exception: res[be] = dict(error=traceback.format_exc()[-3000:])
    print(be, json.dumps(res[be])[:2000], flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
EOF
cat > "$W/roofline.py" <<'EOF'
# Decode step (whole scheduler step, ends in the one .tolist()) vs weights+KV bytes / measured bandwidth, with the
# decode CUDA graphs and without, and the greedy tokens of the two runs compared. MODEL OUT BACKEND RW_BYTES_PER_S
import json, logging, statistics, sys, time, torch
from common.config import ServerConfig
from common.core.request import Req
from common.engine.engine import Engine
from common.wire.sampling_params import SamplingParams
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # the CUDA graphs line
M, be, BW = sys.argv[1], sys.argv[3], float(sys.argv[4]); PROMPT, STEPS = 512, 20; rows, tokens = [], {}
for graphs in (True, False):
  eng = Engine(ServerConfig(model=M, device="cuda", dtype="bfloat16", attention_backend=be, max_running_requests=64,
                            chunked_prefill_size=8192, max_prefill_tokens=16384, max_total_tokens=64 * 1024 + 8192, disable_cuda_graph=not graphs))
  eng.warm_up()
  s, cfg, m = eng.scheduler, eng.hf_config, eng.runner.model
  weights = sum(p.numel() * p.element_size() for p in m.parameters())
  emb = 0 if cfg.tie_word_embeddings else m.model.embed_tokens.weight.numel() * m.model.embed_tokens.weight.element_size()
  kv_tok = eng.kv_pool.bytes_per_page // eng.kv_pool.page_size; g = torch.Generator().manual_seed(0); reqs = []
  for b in (1, 16, 64):
      while len(reqs) < b:
          reqs.append(Req(f"r{len(reqs)}", torch.randint(100, cfg.vocab_size - 1, (PROMPT,), generator=g).tolist(),
                          SamplingParams(max_new_tokens=2048, temperature=0, ignore_eos=True))); s.add_request(reqs[-1])
      for _ in range(3000):  # a failing forward fails its requests: stop instead of spinning
          if len(s.decode.running) >= b: break
          s.step()
      else: raise SystemExit(f"batch {b}: only {len(s.decode.running)} requests running (see the log)")
      for _ in range(5): s.step()
      times = []
      for _ in range(STEPS): t0 = time.perf_counter(); s.step(); times.append(time.perf_counter() - t0)
      with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
          s.step(); torch.cuda.synchronize()
      kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
      ctx = statistics.mean(r.kv_len for r in s.decode.running); step = statistics.median(times) * 1e3
      roof = (weights - emb + b * ctx * kv_tok) / BW * 1e3
      rows.append(dict(backend=be, graphs=graphs, batch=b, ctx=round(ctx), step_ms=round(step, 3), gpu_kernel_ms=round(sum(e.time_range.elapsed_us() for e in kern) / 1e3, 3),
                         kernels=len(kern), roofline_ms=round(roof, 3), step_over_roofline=round(step / roof, 2), tok_s=round(b / step * 1e3)))
      print(rows[-1], flush=True)
  tokens[graphs] = [list(r.output_ids) for r in reqs]; del eng, s, m; torch.cuda.empty_cache()
n = [min(len(a), len(b)) for a, b in zip(tokens[True], tokens[False])]  # the same steps: the same lengths, but compare what both have
diff = [next((i for i in range(k) if a[i] != b[i]), None) for a, b, k in zip(tokens[True], tokens[False], n)]
same = dict(requests=len(n), equal=sum(d is None for d in diff), tokens=sum(n), first_diffs=[d for d in diff if d is not None][:8])
print("graphs vs eager greedy tokens:", same, flush=True)
json.dump(dict(model=M, layers=cfg.num_hidden_layers, weights_bytes=weights, kv_bytes_per_token=kv_tok, rw_bytes_per_s=BW, rows=rows, graphs_vs_eager=same), open(sys.argv[2], "w"), indent=1)
EOF
cat > "$W/ttft.py" <<'EOF'
# TTFT through the router vs a monolithic server (concurrency 1, benchmarks/pd_ttft.measure), and greedy PD == mono. MONO PD OUT LENGTHS REPEAT
import json, statistics, sys, httpx
from benchmarks.pd_ttft import measure
urls, lengths = {"mono": sys.argv[1], "pd": sys.argv[2]}, [int(x) for x in sys.argv[4].split(",")]
same = []
for n in (64, 700):
    body = {"input_ids": list(range(1000, 1000 + n)), "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
    outs = [httpx.post(u + "/generate", json=body, timeout=300).json()["output_ids"] for u in urls.values()]
    same.append(outs[0] == outs[1])
res = measure(urls, lengths, int(sys.argv[5]), 0)
ttft = {k: {L: round(statistics.median(x["ttft"] for x in v if x["length"] == L) * 1e3, 2) for L in lengths} for k, v in res.items()}
out = dict(ttft_ms=ttft, pd_added_ms={L: round(ttft["pd"][L] - ttft["mono"][L], 2) for L in lengths}, pd_greedy_equals_mono=same)
json.dump(dict(out, samples=res), open(sys.argv[3], "w"), indent=1); print(json.dumps(out))
EOF

cat > "$W/summary.py" <<'EOF'
# summary.txt and results.json from what the steps so far left in W: run after every step (a cut run keeps them)
import glob, json, os, re, sys
W, OUT = sys.argv[1:3]; R, L = {}, []
def load(n):
    try: return json.load(open(f"{W}/{n}.json"))
    except Exception: return None
for n in ("env", "parity", "roofline", "pd_ttft"): R[n] = load(n)
R["steps"] = open(f"{W}/steps.txt").read().splitlines()
env = R["env"] or {}
L.append(f"GPU {env.get('gpu')} torch {env.get('torch')} nvcc {str(env.get('nvcc', '?')).split('release')[-1][:16]} | d2d {env.get('d2d_copy_1024MiB_GBps')} GB/s copied, bf16 mm {env.get('bf16_mm_TFLOPs')} TFLOP/s, fp8 index {env.get('fp8_index')}")
L.append("imports: " + ", ".join(f"{k[7:]}={'FAIL' if str(v).startswith('FAIL') else 'ok'}" for k, v in env.items() if k.startswith("import ")))
L += [s for s in R["steps"]]
jit = "".join(open(f, errors="replace").read() for f in sorted(glob.glob(f"{W}/logs/jit/*.log")))
R["kernels_jit_built"] = sorted(set(re.findall(r"Building JIT module (\S+?);", jit)))
unloadable = set(re.findall(r"Failed to load AOT artifact (\S+?):", jit))  # FlashInfer warns twice per module
L.append(f"kernels: {len(unloadable)} carried failed to load; JIT-built {R['kernels_jit_built'] or 'none'}")
for f in ("parity", "roofline"):  # CUDA graphs: sizes, seconds, memory used against what the pool's sizing set aside
    p = f"{W}/logs/{f}.log"
    L += [f"{f}: " + l.split("CUDA graphs: ", 1)[1].strip() for l in (open(p, errors="replace") if os.path.exists(p) else []) if "CUDA graphs: " in l]
p = f"{W}/logs/deterministic_tests.log"  # --enable-deterministic-inference: which parts held (one line each)
L += sorted({l.strip() for l in (open(p, errors="replace") if os.path.exists(p) else []) if l.startswith("deterministic: ")})
for f in sorted(glob.glob(f"{W}/logs/*tests.log")):
    last = [l for l in open(f, errors="replace").read().splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", l)]
    L.append(f"{os.path.basename(f)}: {last[-1] if last else 'no pytest summary'}")
R["transfer"] = []
for f in sorted(glob.glob(f"{W}/logs/bench_*.log")):
    for l in open(f, errors="replace"):
        t = l.split()
        if t and t[0] in ("nixl", "mooncake") and "page-major" in t and len(t) > 9:
            mib, ours = float(t[-7]), float(t[-5]); d2d = env.get("d2d_copy_128MiB_GBps" if mib > 100 else "d2d_copy_45MiB_GBps") or float("nan")
            R["transfer"].append(dict(backend=t[0], case=" ".join(t[1:t.index("page-major")]), MiB=mib, ours_GBps=ours, ratio_vs_raw=float(t[-3]), ratio_vs_d2d=round(ours / d2d, 3)))
            L.append(f"transfer {t[0]:8} {R['transfer'][-1]['case']:30} {mib:6.1f} MiB ours {ours:8.2f} GB/s  /raw {t[-3]}  /d2d {R['transfer'][-1]['ratio_vs_d2d']}")
for be, v in (R["parity"] or {}).items():
    if isinstance(v, dict) and "rows" in v:
        rows = v["rows"]; L.append(f"parity {be:10} lp|max| {max((r['lp_max'] or 0) for r in rows):.4f} top1 {min(r['top1_agree'] for r in rows):.3f} greedy full {sum(r['greedy_full'] for r in rows)}/{len(rows)} gaps@diff {[round(r['top2_gap'], 3) for r in rows if r['top2_gap'] is not None]}")
    elif isinstance(v, dict) and "error" in v: L.append(f"parity {be} ERROR {v['error'].strip().splitlines()[-1][:200]}")
for r in (R["roofline"] or {}).get("rows", []): L.append(f"roofline {r['backend']}{' graphs' if r.get('graphs') else ' eager '} b={r['batch']:3} step {r['step_ms']:7.2f} ms  gpu {r['gpu_kernel_ms']:7.2f} ms  {r['kernels']} kernels  roof {r['roofline_ms']:6.2f} ms  x{r['step_over_roofline']}")
g = (R["roofline"] or {}).get("graphs_vs_eager")
if g: L.append(f"roofline graphs vs eager greedy tokens: {g['equal']}/{g['requests']} requests equal over {g['tokens']} tokens, first diffs at {g['first_diffs']}")
if R["pd_ttft"]: L.append(f"pd ttft ms {R['pd_ttft']['ttft_ms']}  added {R['pd_ttft']['pd_added_ms']}  greedy PD==mono {R['pd_ttft']['pd_greedy_equals_mono']}")
json.dump(R, open(f"{OUT}/results.json", "w"), indent=1); open(f"{OUT}/summary.txt", "w").write("\n".join(L) + "\n")
print("\n".join(L))
EOF

# --------------------------------------------------------------------------------------------- run
# The GPU correctness steps, in this order, after the kernels are built or loaded: one line each (name, time box in
# s, pytest arguments). A new CUDA path (quantized GEMMs, LoRA kernels, deterministic kernels) adds its tests/gpu
# file as one more line at the end; scripts/gpu/README.md.
CHECKS=(
  'gpu_tests 220 tests/gpu/test_flashinfer_attention.py tests/gpu/test_flashinfer_sampling.py tests/gpu/test_cuda_graphs.py tests/gpu/test_flashinfer_parity.py -k "not (float16 and not bfloat16)"'
  'fp8_gemm 60 tests/gpu/test_fp8_gemm.py'
  'deterministic_tests 90 tests/gpu/test_deterministic.py'
)
step probe 120 python3 "$W/probe.py" "$W/env.json"; cat "$W/logs/probe.log" > "$OUT/env.txt"
KERNELS=${KERNELS:-.gpu/kernels}; echo "kernels: $(ls "$KERNELS"/*.so.xz 2>/dev/null | wc -l) carried ($KERNELS)" >> "$W/steps.txt"
JIT_PIDS=()  # each module loaded (carried) or built (MAX_JOBS nvcc units) at once: hd128 prefill (its tensor-core decode too), hd64 prefill and decode, sampling
if [ -n "$FAKES" ]; then cp "$FAKES"/jit/*.log "$W/logs/jit/" 2>/dev/null; else
  for spec in "bfloat16 32 8 128 EXTEND 6" "bfloat16 9 3 64 EXTEND 6" "bfloat16 9 3 64 DECODE 3" "sampling 3"; do
    set -- $spec; MAX_JOBS=${!#} timeout -k 5 420 python3 "$W/prewarm.py" "${@:1:$#-1}" > "$W/logs/jit/${4:-$1}-${5:-k}.log" 2>&1 & JIT_PIDS+=($!)
  done
fi
step gen_models 150 bash -c "python3 $W/gen_model.py smol /tmp/m_smol 30 0.05; python3 $W/gen_model.py 8b /tmp/m_8b 8 0.02"
step transfer_tests 180 python3 -m pytest tests/gpu/test_gpu_transfer.py -q -rA -p no:cacheprovider --timeout 150
for p in "${JIT_PIDS[@]}"; do while kill -0 "$p" 2>/dev/null && (( SECONDS - T0 < 330 )); do sleep 2; done; done
JIT=ok; for f in "$W"/logs/jit/*.log; do grep -q "^JIT OK" "$f" || JIT=failed; done
for p in "${JIT_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && JIT=timeout; done
grep -h "JIT OK" "$W"/logs/jit/*.log | tee -a "$W/steps.txt"; echo "jit=$JIT at $((SECONDS - T0))s" | tee -a "$W/steps.txt"; summarize
for be in nixl mooncake; do  # ratios are ours/raw in the same processes: measured only once no nvcc shares the CPU
  cases=("2k-prompt fragmented" "256MiB pool"); [ $be = nixl ] && cases+=("2k-prompt fragmented TP 1->3")
  if [ $JIT = timeout ]; then skip "bench_$be" "kernels still compiling"; continue; fi
  step "bench_$be" 150 python3 benchmarks/transfer_bench.py --device cuda --backends $be --layouts page-major --repeat 3 --cases "${cases[@]}"
done
ATTN=flashinfer; [ $JIT = ok ] || ATTN=torch
for c in "${CHECKS[@]}"; do
  eval "set -- $c"; [ $JIT = timeout ] && { skip "$1" "kernels still compiling"; continue; }
  step "$1" "$2" python3 -m pytest "${@:3}" -q -rA -p no:cacheprovider --timeout $(( $2 - 20 ))
done
step parity 150 python3 "$W/parity.py" /tmp/m_smol "$W/parity.json" "$([ $ATTN = flashinfer ] && echo flashinfer,torch || echo torch)"
BW=$(python3 -c "import json; print(json.load(open('$W/env.json'))['d2d_rw_GBps'] * 1e9)" 2>/dev/null || echo 3.0e12)
step roofline 150 python3 "$W/roofline.py" /tmp/m_8b "$W/roofline.json" "$ATTN" "$BW"
if [ -n "$FAKES" ]; then
  step pd_ttft 90 python3 "$W/ttft.py" http://127.0.0.1:30500 http://127.0.0.1:8000 "$W/pd_ttft.json" 16,512,4096 5
elif (( $(left) > 100 )); then  # 1P1D on the one GPU through `tandem up` (NIXL, cuda_ipc) vs a monolithic server
  python3 -m tandem up --model /tmp/m_8b --device cuda --transfer-backend nixl --port 8000 --startup-timeout 200 \
    -- --max-total-tokens 65536 --attention-backend "$ATTN" > "$W/logs/up.log" 2>&1 & UP=$!
  python3 -m tandem serve --model /tmp/m_8b --device cuda --port 30500 --max-total-tokens 65536 --mem-fraction-static 0.5 --attention-backend "$ATTN" > "$W/logs/mono.log" 2>&1 & MONO=$!
  if wait_http http://127.0.0.1:8000/readiness $(( $(left) - 40 )) $UP && wait_http http://127.0.0.1:30500/health 30 $MONO; then
    echo "pd ready at $((SECONDS - T0))s" >> "$W/steps.txt"
    step pd_ttft 90 python3 "$W/ttft.py" http://127.0.0.1:30500 http://127.0.0.1:8000 "$W/pd_ttft.json" 16,512,4096 5
  else skip pd_ttft "pd not ready at $((SECONDS - T0))s"; fi
  kill -INT $UP 2>/dev/null; kill $MONO 2>/dev/null; sleep 3; kill -9 $UP $MONO 2>/dev/null
else skip pd_ttft deadline; fi

# ----------------------------------------------------------------------------------------- collect
mkdir -p "$W/built"  # the kernels built here (not carried, or carried but not loadable): into .gpu/kernels/ for next time
for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
  [ -f "$so" ] && [ "$(basename "$(dirname "$so")")" = "$(basename "$so" .so)" ] && python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.compress(open(sys.argv[1], 'rb').read()))" "$so" "$W/built/$(basename "$so").xz"
done
[ -n "$(ls "$W/built")" ] && tar -C "$W/built" -cf "$OUT/kernels.tar" .
[ -f "$OUT/kernels.tar" ] && (( $(stat -c %s "$OUT/kernels.tar") > 16000000 )) && rm -f "$OUT/kernels.tar"
for c in "${CHECKS[@]}"; do eval "set -- $c"; cat "$W/logs/$1.log" 2>/dev/null; done > "$OUT/gpu_tests.log"
cat "$W"/logs/transfer_tests.log "$W"/logs/bench_*.log > "$OUT/transfer.log" 2>/dev/null
nvidia-smi > "$W/logs/nvidia-smi.txt" 2>&1; tar -C "$W" -cJf "$OUT/logs.tar.xz" logs steps.txt 2>/dev/null
echo; echo "===== SUMMARY ====="; python3 "$W/summary.py" "$W" "$OUT"
echo "total $((SECONDS - T0))s; files: $(ls "$OUT" | tr '\n' ' ')"
