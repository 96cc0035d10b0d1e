"""ditops under diffusers' context parallelism (``enable_parallelism``), both orders of
``apply`` and ``enable_parallelism``: every patched family with a context-parallel plan in
diffusers 0.42 (FLUX, Wan, Qwen-Image and Qwen-Image-Edit, FLUX.2, LTX-Video, ChronoEdit, Helios, MiniMax-H3) at
tiny widths; Z-Image, HunyuanVideo, SD3 and the others have no plan. LTX-2's plan fails in
diffusers 0.42.1 without ditops (its audio-video cross-attentions take the video RoPE table
unsplit: "The size of tensor a (16) must match the size of tensor b (32)"), and so does Helios's
with history tokens (a shard's self-attention counts its history tokens against the whole
video's length: rel_err 0.25 without ditops), tested here without them. Each rank's
output must match the single-process run, and every attention call must get the parallel
config exactly where the unpatched model's does (Wan's cross-attention runs without it there
too).

Under pytest: two CPU processes on gloo, Ulysses degree 2. Ring attention needs an attention
backend that returns the log-sum-exp, and none of diffusers' does on CPU (native refuses
``return_lse``), so the ring case is skipped here. On GPUs, the same checks under torchrun:

    torchrun --nproc-per-node 2 tests/test_diffusers_context_parallel.py --parallel ulysses
    torchrun --nproc-per-node 2 tests/test_diffusers_context_parallel.py --parallel ring --backend _native_cudnn

``--real-width`` gives the models their real attention widths (FLUX and Qwen-Image 24 x 128,
Wan 12 x 128; everything else stays tiny).
"""

import argparse
import importlib
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

diffusers = pytest.importorskip("diffusers")
integration = pytest.importorskip("ditops.integrations.diffusers")

sys.path.insert(0, os.path.dirname(__file__))  # the tiny models, also when torchrun runs this file
from model_runs import TOLERANCE  # noqa: E402
from tiny_models import (tiny_chronoedit, tiny_flux, tiny_flux2, tiny_helios, tiny_ltx, tiny_minimax_h3,  # noqa: E402
                         tiny_qwen, tiny_wan)


def coverage_model(builder, blocks):
    """A float32 tiny model of tiny_models.py (one the coverage tests build) as this file's
    builders give one: (model, inputs, blocks) in ``dtype`` (its activations; ids and timesteps
    as they are). Tiny widths only (real_width is ignored)."""
    def build(dtype, real_width=False):
        model, inputs = builder()
        return model.to(dtype), {key: value.to(dtype) if "hidden_states" in key else value
                                 for key, value in inputs.items()}, blocks
    return build


BUILDERS = {"flux": tiny_flux, "wan": tiny_wan, "qwen-image": tiny_qwen,
            "qwen-image-edit": lambda dtype, **width: tiny_qwen(dtype, edit=True, **width),  # modulate_index split too
            "flux2": coverage_model(tiny_flux2, 4), "ltx-video": coverage_model(tiny_ltx, 2),
            "chronoedit": coverage_model(tiny_chronoedit, 2), "helios": coverage_model(lambda: tiny_helios(layers=40, history=False), 40),  # its plan names blocks 0-39
            "minimax-h3": coverage_model(tiny_minimax_h3, 2)}
DIFFUSERS_MODULES = ("transformer_flux", "transformer_wan", "transformer_qwenimage", "transformer_flux2",
                     "transformer_ltx", "transformer_chronoedit", "transformer_helios", "transformer_minimax_h3")


def shardable(name, inputs) -> dict:
    """The tiny inputs with every sequence the plans split even (FLUX and Qwen-Image split their text)."""
    if name == "flux":
        return {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :4], "txt_ids": inputs["txt_ids"][:4]}
    if name.startswith("qwen-image"):
        # No text mask: diffusers 0.42.1 splits it with the tokens and hands each rank's shard of it to
        # attention over the whole sequence; on 2 H200s that gave NaN in some patched runs (with ditops'
        # reference backend too), and with a mask ditops now runs diffusers' own attention there anyway
        # (tests/test_diffusers_deployments.py). The tiny mask is all ones.
        return {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :6], "encoder_hidden_states_mask": None}
    if name.startswith("ltx"):
        # No text mask: diffusers 0.42.1 splits it with the text and Ulysses attention then masks the
        # gathered keys with one rank's half (LTX-Video: "output with shape [2, 1, 32, 6] doesn't
        # match the broadcast shape [2, 2, 32, 6]" without ditops too); the tiny mask is all ones.
        # LTX-2's plan needs the argument given (None): its hook looks it up by position otherwise.
        return {**inputs, "encoder_attention_mask": None}
    if name == "flux2":  # its plan splits batched ids ([B, S, 4]); FLUX.2 takes the first item's
        text = inputs["encoder_hidden_states"][:, :4]
        return {**inputs, "encoder_hidden_states": text, "img_ids": inputs["img_ids"].expand(len(text), -1, -1),
                "txt_ids": inputs["txt_ids"][:4].expand(len(text), -1, -1)}
    return inputs


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].float()


def record_attention_calls() -> list:
    """Whether each dispatch_attention_fn call got a parallel config, in call order."""
    import diffusers.models.attention_dispatch as dispatch

    calls, original = [], dispatch.dispatch_attention_fn

    def recorded(*args, parallel_config=None, **kwargs):
        calls.append(parallel_config is not None)
        return original(*args, parallel_config=parallel_config, **kwargs)

    dispatch.dispatch_attention_fn = recorded
    for name in DIFFUSERS_MODULES:  # diffusers' processors imported it by name
        setattr(importlib.import_module(f"diffusers.models.transformers.{name}"), "dispatch_attention_fn", recorded)
    return calls


def build(name, device, dtype, backend, real_width=False):
    model, inputs, blocks = BUILDERS[name](dtype, real_width=real_width)
    inputs = {key: value.to(device) if torch.is_tensor(value) else value for key, value in shardable(name, inputs).items()}
    model = model.to(device)
    if backend is not None:
        model.set_attention_backend(backend)
    return model, inputs, blocks


def relative_error(output, reference) -> float:
    return ((output - reference).norm() / reference.norm()).item()


FP8_TOLERANCE = 2e-2  # relative L2: a value reordered by the split may round to the neighbouring FP8 step


def check(device, dtype, parallel: str, backend, real_width=False, quantize=None) -> list:
    """On every rank of the initialized process group: each model, both orders. Returns lines to
    print; raises AssertionError listing every case that failed.

    In float32 each output must match the one-process run elementwise. In bfloat16 the parallel
    run reorders sums in attention, so the bar is the one the benchmark states: the error
    against the one-process unpatched run at most 1.5x the larger of the unpatched parallel
    run's and ditops' own one-process error (whatever ditops rounds differently, the parallel
    split must not add to it). With ``quantize="fp8"`` in float32 the parallel run must match
    ditops' own one-process FP8 run (scales are per token, so the split changes none) within
    FP8_TOLERANCE. In bfloat16 the split's reordered attention sums round differently and FP8
    codes near a rounding boundary then flip (2 H200s: Helios' 40 tiny layers took the parallel
    FP8 run 3.3e-2 from the one-process one, both about 4e-2 from the bfloat16 one), so the FP8
    run takes the bfloat16 bar: its error against the one-process unpatched run at most 1.5x
    the larger of the unpatched parallel run's and ditops' one-process FP8 error."""
    from diffusers import ContextParallelConfig

    calls = record_attention_calls()
    degree = dist.get_world_size()
    lines, failures = [], []
    for name in BUILDERS:
        model, inputs, blocks = build(name, device, dtype, backend, real_width)
        reference = run(model, inputs)  # one process, no parallelism
        integration.apply(model, quantize=quantize)
        single = run(model, inputs)
        single_error = relative_error(single, reference)  # ditops in one process
        integration.remove(model)
        model.enable_parallelism(config=ContextParallelConfig(**{f"{parallel}_degree": degree}))
        calls.clear()
        baseline_error = relative_error(run(model, inputs), reference)  # unpatched, in parallel
        expected_calls = list(calls)
        if not any(expected_calls):
            failures.append(f"{name}: no attention call got the parallel config without ditops")
        for order in ("apply first", "enable_parallelism first"):
            model, inputs, blocks = build(name, device, dtype, backend, real_width)
            if order == "apply first":
                integration.apply(model, quantize=quantize)
            model.enable_parallelism(config=ContextParallelConfig(**{f"{parallel}_degree": degree}))
            if order == "enable_parallelism first":
                integration.apply(model, quantize=quantize)
            calls.clear()
            patched = run(model, inputs)
            error = relative_error(patched, reference)
            detail = f"unpatched parallel {baseline_error:.2e}, ditops one process {single_error:.2e}"
            if quantize is not None:
                quantized_error = relative_error(patched, single)  # against ditops' one-process run
                detail += f"; {quantize} one process to parallel {quantized_error:.2e}"
            lines.append(f"{name:15} {parallel}{degree} {order:25} cp calls {sum(calls)}/{len(calls)} "
                         f"rel_err {error:.2e} ({detail})")
            if calls != expected_calls:
                failures.append(f"{name}, {order}: calls with the parallel config {calls}, wanted {expected_calls}")
            if dtype == torch.float32 and quantize is not None:
                if not quantized_error <= FP8_TOLERANCE:  # also catches NaN
                    failures.append(f"{name}, {order}: rel_err {quantized_error:.2e} against ditops' one-process "
                                    f"{quantize} run")
            elif dtype == torch.float32:
                tolerance = TOLERANCE[dtype] * blocks
                if not torch.allclose(patched, reference, atol=tolerance, rtol=tolerance):
                    failures.append(f"{name}, {order}: not within {tolerance} of the one-process run (rel_err {error:.2e})")
            elif not error <= 1.5 * max(baseline_error, single_error):  # also catches NaN
                failures.append(f"{name}, {order}: rel_err {error:.2e} > 1.5x max(unpatched parallel "
                                f"{baseline_error:.2e}, ditops one process {single_error:.2e})")
    if failures:
        raise AssertionError("\n".join(lines + ["failed:"] + failures))
    return lines


def _cpu_worker(rank: int, port: int, outcomes: str) -> None:
    """Ulysses, then ring, on gloo; rank 0 writes each one's outcome ("ok" or the error) to ``outcomes``/<mode>."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # diffusers places rank r on accelerator r % count, and a CPU host counts none
    torch.accelerator.device_count = lambda: 1
    # diffusers 0.42.1 calls logger.warning_once (Wan's timestep is not split) on a logger without it
    import diffusers.hooks.context_parallel as context_parallel

    if not hasattr(context_parallel.logger, "warning_once"):
        context_parallel.logger.warning_once = context_parallel.logger.warning
    try:
        for mode, parallel, quantize in (("ulysses", "ulysses", None), ("ring", "ring", None),
                                         ("ulysses-fp8", "ulysses", "fp8")):
            try:
                check(torch.device("cpu"), torch.float32, parallel, None, quantize=quantize)
                outcome = "ok"
            except Exception as error:  # noqa: BLE001  (reported to the test, which fails or skips on it)
                outcome = f"{type(error).__name__}: {error}"
            if rank == 0:
                with open(os.path.join(outcomes, mode), "w") as file:
                    file.write(outcome)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cpu_outcomes(tmp_path_factory) -> dict:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outcomes = tmp_path_factory.mktemp("context_parallel")
    torch.multiprocessing.spawn(_cpu_worker, args=(port, str(outcomes)), nprocs=2)
    return {path.name: path.read_text() for path in outcomes.iterdir()}


def test_ulysses_on_two_cpu_processes_matches_one_process_in_both_orders(cpu_outcomes):
    assert cpu_outcomes["ulysses"] == "ok"


def test_ulysses_with_fp8_on_two_cpu_processes_matches_one_process_fp8_in_both_orders(cpu_outcomes):
    assert cpu_outcomes["ulysses-fp8"] == "ok"


def test_ring_on_two_cpu_processes_matches_one_process_in_both_orders(cpu_outcomes):
    if "return_lse" in cpu_outcomes["ring"]:
        pytest.skip("ring attention needs an attention backend that returns the log-sum-exp; diffusers' CPU "
                    f"backend refuses it ({cpu_outcomes['ring']}); run this file under torchrun on GPUs")
    assert cpu_outcomes["ring"] == "ok"


if __name__ == "__main__":  # torchrun --nproc-per-node N tests/test_diffusers_context_parallel.py ...
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", choices=["ulysses", "ring"], default="ulysses")
    parser.add_argument("--backend", default=None, help="diffusers attention backend (ring: one that returns LSE, "
                                                        "e.g. _native_cudnn or flash)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--real-width", action="store_true", help="the real models' attention widths (heads x 128)")
    parser.add_argument("--quantize", choices=["fp8"], default=None, help="apply(model, quantize=...)")
    arguments = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    lines = check(torch.device("cuda", rank), getattr(torch, arguments.dtype), arguments.parallel, arguments.backend,
                  arguments.real_width, arguments.quantize)
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()
