"""Which attention backend `--attention-backend` gives on this device, dtype and head_dim, and the combinations
refused at start-up naming the flags. Imports no torch: `tandem serve` checks the device before it loads
anything (tandem/server.py `check_before_loading`)."""

from __future__ import annotations

from common.wire.user_error import UserError

FLASHINFER_DTYPES = ("bfloat16", "float16")
# head dims FlashInfer's prebuilt paths cover (SGLang's checks): others compile, then fail in plan() with
# "Invalid configuration" (below 64 always)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


class AttentionChoiceError(UserError):
    """The flags ask for an attention backend that cannot run here; the message names them."""


def check_attention_device(name: str, device: str) -> None:
    """The refusal that needs no model: FlashInfer runs on CUDA only."""
    if name == "flashinfer" and device != "cuda":
        raise AttentionChoiceError(
            "--attention-backend flashinfer needs --device cuda; use --attention-backend torch on cpu"
        )


def choose_attention_backend(name: str, device: str, dtype: str, head_dim: int | None = None) -> tuple[str, str | None]:
    """The backend for `--attention-backend name` on `device` with weights of `dtype` and MHA heads of
    `head_dim` (None: MLA, which FlashInfer's MHA kernels do not serve anyway), and a warning when "auto"
    cannot take the fast one; a combination that cannot run is refused at start-up, naming the flags,
    instead of failing every forward (FlashInfer has no float32 kernels, nor kernels for every head_dim)."""
    fast_head = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    if name == "auto" and device == "cuda" and dtype not in FLASHINFER_DTYPES:
        return "torch", (
            f"--dtype {dtype} on --device cuda: FlashInfer has no {dtype} kernels, using the torch attention "
            "backend (slower); use --dtype bfloat16 for FlashInfer"
        )
    if name == "auto" and device == "cuda" and not fast_head:
        return "torch", (
            f"head_dim {head_dim}: FlashInfer serves head_dim {', '.join(map(str, FLASHINFER_HEAD_DIMS))}, "
            "using the torch attention backend (slower)"
        )
    if name == "auto":
        return ("flashinfer" if device == "cuda" else "torch"), None
    check_attention_device(name, device)
    if name == "flashinfer" and dtype not in FLASHINFER_DTYPES:
        raise AttentionChoiceError(
            f"--attention-backend flashinfer has no {dtype} kernels: use --dtype bfloat16 (or float16), "
            "or --attention-backend torch"
        )
    if name == "flashinfer" and not fast_head:
        raise AttentionChoiceError(
            f"--attention-backend flashinfer: this model's head_dim is {head_dim}, FlashInfer serves "
            f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}; use --attention-backend torch (or auto)"
        )
    return name, None


def resolved_backend(name: str, device: str, kind: str, quantized: bool) -> str:
    """What `--attention-backend name` builds for a pool of `kind` (mha / mla), FP8 or not: "auto" is
    FlashInfer for a plain MHA pool on CUDA, torch otherwise."""
    if name != "auto":
        return name
    return "flashinfer" if device == "cuda" and kind == "mha" and not quantized else "torch"
