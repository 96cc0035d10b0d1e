"""ditops.integrations.diffusers inside diffusers' deployment features, on CPU with tiny
random-weight models: the attention processor contract (backend and parallel config), hooks
registered before and after ``apply``, the Wan block on a sequence shard, layerwise casting,
group offloading, accelerate's CPU offloads, regional compilation, and grad mode (no
torch.no_grad): q, k and v of one projection, and every family's gradients against diffusers'.
Context parallelism on two processes is in test_diffusers_context_parallel.py."""

import copy
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
integration = pytest.importorskip("ditops.integrations.diffusers")

import model_runs  # noqa: E402
import tiny_models  # noqa: E402
from diffusers.hooks import HookRegistry, ModelHook  # noqa: E402
from fp8_checks import TINY  # noqa: E402
from model_runs import TOLERANCE  # noqa: E402
from tiny_models import tiny_flux, tiny_qwen, tiny_wan, tiny_z_image  # noqa: E402

BUILDERS = {"flux": tiny_flux, "wan": tiny_wan, "qwen-image": tiny_qwen, "z-image": tiny_z_image}
FIRST_BLOCK = {"flux": "transformer_blocks.0", "wan": "blocks.0", "qwen-image": "transformer_blocks.0",
               "z-image": "layers.0"}
DIFFUSERS_MODULES = ("transformer_flux", "transformer_wan", "transformer_qwenimage", "transformer_z_image")


def output(model, inputs) -> torch.Tensor:
    sample = model(**inputs, return_dict=False)[0]
    return torch.stack(sample) if isinstance(sample, list) else sample  # Z-Image: one per image


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return output(model, inputs)


def assert_close_to(patched, expected, blocks):
    tolerance = TOLERANCE[torch.float32] * blocks
    torch.testing.assert_close(patched, expected, atol=tolerance, rtol=tolerance)


def attention_calls(monkeypatch) -> list:
    """Every dispatch_attention_fn call of the model's processors and of ditops', as its
    (backend, parallel_config); the attention itself runs without a parallel config."""
    import diffusers.models.attention_dispatch as dispatch

    calls, original = [], dispatch.dispatch_attention_fn

    def recorded(*args, backend=None, parallel_config=None, **kwargs):
        calls.append((backend, parallel_config))
        return original(*args, backend=backend, parallel_config=None, **kwargs)

    monkeypatch.setattr(dispatch, "dispatch_attention_fn", recorded)
    for name in DIFFUSERS_MODULES:  # diffusers' processors imported it by name
        monkeypatch.setattr(f"diffusers.models.transformers.{name}.dispatch_attention_fn", recorded)
    return calls


def set_parallel_config(model, config) -> None:
    """What enable_parallelism does to the processors (models/modeling_utils.py, diffusers
    0.42): every attention processor that has a _parallel_config attribute gets the config.
    The rest of enable_parallelism needs torch.distributed; the two-process test runs it."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    for module in model.modules():
        if (isinstance(module, (Attention, MochiAttention, AttentionModuleMixin))
                and hasattr(module.processor, "_parallel_config")):
            module.processor._parallel_config = config


@pytest.mark.parametrize("order", ["apply first", "configure first"])
@pytest.mark.parametrize("name", BUILDERS)
def test_the_attention_backend_and_parallel_config_reach_every_attention_call(name, order, monkeypatch):
    """Each attention call gets the backend and the parallel config exactly as in the unpatched
    model (Wan's cross-attention runs without the config there too), whichever came first."""
    config = object()  # a recorded marker: the attention runs without it
    calls = attention_calls(monkeypatch)
    model, inputs, blocks = BUILDERS[name](torch.float32)
    model.set_attention_backend("native")
    set_parallel_config(model, config)
    expected = run(model, inputs)
    expected_calls = [(backend, got is config) for backend, got in calls]
    calls.clear()

    model, inputs, blocks = BUILDERS[name](torch.float32)
    if order == "configure first":
        model.set_attention_backend("native")
        set_parallel_config(model, config)
    integration.apply(model)
    if order == "apply first":
        model.set_attention_backend("native")
        set_parallel_config(model, config)
    assert_close_to(run(model, inputs), expected, blocks)
    assert [(backend, got is config) for backend, got in calls] == expected_calls
    assert any(with_config for _, with_config in expected_calls)
    ditops_processors = [m.processor for m in model.modules()
                         if isinstance(getattr(m, "processor", None), integration.patching.DitopsProcessor)]
    assert ditops_processors and all(p._parallel_config is config for p in ditops_processors)
    integration.remove(model)  # the processors put back hold what was set meanwhile
    assert all(m.processor._parallel_config is config and m.processor._attention_backend == "native"
               for m in model.modules() if hasattr(m, "processor"))


class CountingHook(ModelHook):
    """Counts forwards and scales the first input by 1.5: a hook whose effect shows in the output."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        if args:
            return (args[0] * 1.5,) + args[1:], kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: kwargs[first] * 1.5}


def register(module, name) -> CountingHook:
    hook = CountingHook()
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    return hook


@pytest.mark.parametrize("name", BUILDERS)
def test_hooks_registered_before_and_after_apply_run_and_stay_after_remove(name):
    model, inputs, blocks = BUILDERS[name](torch.float32)
    block = model.get_submodule(FIRST_BLOCK[name])
    before = register(block, "before")
    register(block, "after")
    expected = run(model, inputs)  # both hooks, no ditops
    HookRegistry.check_if_exists_or_initialize(block).remove_hook("after")

    integration.apply(model)
    after = register(block, "after")
    before.calls = 0
    assert_close_to(run(model, inputs), expected, blocks)
    assert before.calls == after.calls == 1

    integration.remove(model)
    assert torch.equal(run(model, inputs), expected)
    assert before.calls == after.calls == 2
    registry = HookRegistry.check_if_exists_or_initialize(block)
    registry.remove_hook("after")
    registry.remove_hook("before")
    assert block.forward.__func__ is type(block).forward  # nothing of ditops left in the chain


def test_remove_finds_its_forward_under_hooks_registered_after_apply():
    model, inputs, _ = tiny_flux(torch.float32)
    expected = run(model, inputs)
    integration.apply(model)
    block = model.transformer_blocks[0]
    hook = register(block, "after")
    integration.remove(model)
    assert block._diffusers_hook._fn_refs[0].forward.__func__ is type(block).forward
    hook.calls = 0
    HookRegistry.check_if_exists_or_initialize(block).remove_hook("after")
    assert torch.equal(run(model, inputs), expected) and hook.calls == 0


@pytest.mark.parametrize("name, module", [("flux", "transformer_blocks.0.norm2"), ("flux", "transformer_blocks.1.attn.norm_k"),
                                          ("wan", "blocks.0.attn1.norm_q"), ("qwen-image", "transformer_blocks.0.img_norm2"),
                                          ("z-image", "layers.1.ffn_norm1")])
def test_a_hook_on_a_fused_norm_sends_the_call_back_to_diffusers_and_runs(name, module):
    model, inputs, blocks = BUILDERS[name](torch.float32)
    norm = model.get_submodule(module)
    hook = register(norm, "count")
    expected, expected_calls = run(model, inputs), hook.calls
    integration.apply(model)
    with pytest.warns(UserWarning, match=f"{module.split('.')[-1]} has diffusers hook\\(s\\) count"):
        patched = run(model, inputs)
    assert_close_to(patched, expected, blocks)
    assert hook.calls == 2 * expected_calls


def test_the_wan_block_on_half_the_sequence_with_the_shard_tables_matches_diffusers():
    """Context parallelism hands each block a shard of the tokens and the rows of the RoPE
    tables for that shard (diffusers' _cp_plan splits the rope outputs): the second half here."""
    model, inputs, _ = tiny_wan(torch.float32)
    block = model.blocks[0]
    generator = torch.Generator().manual_seed(2)
    tokens, width = 48, model.config.num_attention_heads * model.config.attention_head_dim
    with torch.no_grad():
        cos, sin = model.rope(inputs["hidden_states"])  # [1, S, 1, Dh] for the S = 48 tokens
        shard = slice(tokens // 2, tokens)
        arguments = (torch.randn(2, tokens // 2, width, generator=generator),
                     torch.randn(2, 7, width, generator=generator),
                     torch.randn(2, 6, width, generator=generator), (cos[:, shard], sin[:, shard]))
        expected = block(*arguments)
        integration.apply(model)
        patched = block(*arguments)
    assert_close_to(patched, expected, 1)


def test_layerwise_casting_gives_the_unpatched_result():
    """float8 storage, float32 compute; with the default skip patterns and with none."""
    for skip in (None, ()):
        reference, inputs, blocks = tiny_wan(torch.float32)
        model, _, _ = tiny_wan(torch.float32)
        options = {} if skip is None else {"skip_modules_pattern": skip}
        for m in (reference, model):
            m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32, **options)
        integration.apply(model)
        assert_close_to(run(model, inputs), run(reference, inputs), blocks)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_gives_the_unpatched_result(offload_type):
    model, inputs, blocks = tiny_flux(torch.float32)
    expected = run(model, inputs)
    integration.apply(model)
    options = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    model.enable_group_offload(torch.device("cpu"), offload_type=offload_type, **options)
    assert_close_to(run(model, inputs), expected, blocks)


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_accelerate_cpu_offload_gives_the_unpatched_result(mode):
    """What a pipeline's enable_model_cpu_offload / enable_sequential_cpu_offload put on the
    transformer, with CPU as the execution device: sequential offload keeps the weights on the
    meta device outside their module's hook, so a ditops forward that read them directly
    would fail; the hooks send those calls back to diffusers' code."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (diffusers' CPU offload uses it)")
    for name in ("flux", "wan"):
        model, inputs, blocks = BUILDERS[name](torch.float32)
        expected = run(model, inputs)
        integration.apply(model)
        if mode == "model":
            accelerate.cpu_offload_with_hook(model, execution_device=torch.device("cpu"))
        else:
            accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warnings naming the hooks
            assert_close_to(run(model, inputs), expected, blocks)


def test_regional_compilation_of_the_patched_model_runs_the_ops_in_one_graph_per_block():
    model, inputs, blocks = tiny_flux(torch.float32)
    expected = run(model, inputs)
    integration.apply(model)
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")  # traced by dynamo: a graph break raises
    assert_close_to(run(model, inputs), expected, blocks)
    assert all(block._compiled_call_impl is not None for block in model.transformer_blocks)


def coverage_families() -> dict:
    """Every family test_diffusers_coverage.py patches beyond the four above, as its tiny builder."""
    return {"chroma": tiny_models.tiny_chroma, "longcat-image": tiny_models.tiny_longcat_image,
            "ovis-image": tiny_models.tiny_ovis_image, "bria": tiny_models.tiny_bria,
            "bria-fibo": tiny_models.tiny_bria_fibo, "wan-vace": tiny_models.tiny_wan_vace,
            "wan-animate": tiny_models.tiny_wan_animate, "chronoedit": tiny_models.tiny_chronoedit,
            "skyreels-v2": tiny_models.tiny_skyreels_v2, "sd3.5": lambda: tiny_models.tiny_sd3(sd35=True),
            "flux2": tiny_models.tiny_flux2, "hunyuan-video": tiny_models.tiny_hunyuan_video,
            "hunyuan-video-1.5": tiny_models.tiny_hunyuan_video15, "hunyuan-image": tiny_models.tiny_hunyuan_image,
            "hunyuan-video-framepack": tiny_models.tiny_hunyuan_video_framepack, "lumina2": tiny_models.tiny_lumina2,
            "cosmos-2.5": lambda: tiny_models.tiny_cosmos(image_context=True),
            "kandinsky5": tiny_models.tiny_kandinsky5, "hidream": tiny_models.tiny_hidream,
            "ltx-video": tiny_models.tiny_ltx, "ltx-2": tiny_models.tiny_ltx2, "helios": tiny_models.tiny_helios,
            "minimax-h3": tiny_models.tiny_minimax_h3}


@pytest.mark.parametrize("hook", ["layerwise casting", "group offload (leaf)", "group offload (block)",
                                  "sequential cpu offload"])
@pytest.mark.parametrize("name", coverage_families())
def test_every_family_under_diffusers_hooks_gives_the_unpatched_result(name, hook):
    """Layerwise casting (float8 storage, float32 compute, on both models), group offloading and
    accelerate's sequential CPU offload applied after ``apply``: the patched output matches the
    unpatched model's (where a hook sits on a fused norm, the call goes back to diffusers' code)."""
    if (name, hook) == ("ltx-2", "sequential cpu offload"):
        pytest.skip("fails without ditops in diffusers 0.42.1 / accelerate: AudioVisualModelOutput.__init__() "
                    "missing 1 required positional argument: 'audio_sample'")
    build = coverage_families()[name]
    (reference, inputs), (model, _) = build(), build()
    if hook == "layerwise casting":
        for m in (reference, model):
            m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    expected = model_runs.run(reference, inputs)
    integration.apply(model)
    if hook.startswith("group offload"):
        options = {"offload_type": "leaf_level"} if "leaf" in hook else {"offload_type": "block_level",
                                                                         "num_blocks_per_group": 1}
        model.enable_group_offload(torch.device("cpu"), **options)
    elif hook == "sequential cpu offload":
        accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings naming the hooks
        patched = model_runs.run(model, inputs)
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE[torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: weights move between the CPU and the GPU")
@pytest.mark.parametrize("mode", ["block_level", "leaf_level", "sequential", "model"])
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_offloading_to_the_gpu_gives_the_unpatched_result(name, mode):
    model, inputs, blocks = BUILDERS[name](torch.float32)
    cuda = torch.device("cuda")
    inputs = {key: value.to(cuda) if torch.is_tensor(value) else value for key, value in inputs.items()}
    expected = run(model.to(cuda), inputs)
    model = model.cpu()
    integration.apply(model)
    if mode in ("block_level", "leaf_level"):
        options = {"num_blocks_per_group": 1} if mode == "block_level" else {}
        model.enable_group_offload(cuda, offload_device=torch.device("cpu"), offload_type=mode, use_stream=True, **options)
    else:
        accelerate = pytest.importorskip("accelerate")
        if mode == "model":
            accelerate.cpu_offload_with_hook(model, execution_device=cuda)
        else:
            accelerate.cpu_offload(model, execution_device=cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings naming the hooks
        assert_close_to(run(model, inputs), expected, blocks)


def test_qwen_text_mask_under_context_parallelism_runs_diffusers_attention(monkeypatch):
    """With a text mask and a parallel config, Qwen-Image's attention is diffusers' own (see
    QwenQKNormRopeProcessor); without a config it is ditops'. The parallel config is faked on
    the ditops processors only, so diffusers' processor still attends in one process. (Without
    a mask, the parallel path is ditops': tests/test_diffusers_context_parallel.py.)"""
    from ditops.integrations.diffusers.qwen_image import QwenQKNormRopeProcessor

    model, inputs, blocks = tiny_qwen(torch.float32)
    expected = run(model, inputs)
    integration.apply(model)
    original_class = type(model.transformer_blocks[0].attn.processor.original)
    calls = []
    original_call = original_class.__call__

    def recorded(self, *args, **kwargs):
        calls.append(True)
        return original_call(self, *args, **kwargs)

    monkeypatch.setattr(original_class, "__call__", recorded)
    assert_close_to(run(model, inputs), expected, blocks)
    assert calls == []  # one process: ditops' qk_norm_rope_ path
    monkeypatch.setattr(QwenQKNormRopeProcessor, "_parallel_config", property(lambda self: "a parallel config"))
    assert_close_to(run(model, inputs), expected, blocks)  # the blocks' norms stay ditops'
    assert calls == [True] * len(model.transformer_blocks)


# ----- grad mode (no torch.no_grad): q and k of a joint projection ------------------------------

# (family, how its q, k and v come out of one projection): "fp8", apply(quantize="fp8") joins them
# into one FP8 GEMM; "fused", diffusers' fuse_qkv_projections before apply; None, the family's own
# (FLUX.2's single blocks; HunyuanVideo's single blocks project their video and text rows together,
# with "fp8" as FP8 rows). SD3.5 chunks its joint FP8 projection too, before out-of-place q/k norms.
JOINT_PROJECTIONS = [("flux", "fp8"), ("flux", "fused"), ("flux2", None), ("flux2", "fp8"), ("sd3.5", "fp8"),
                     ("wan", "fused"), ("helios", "fused"), ("minimax-h3", "fp8"), ("minimax-h3", "fused"),
                     ("hunyuan-video", None), ("hunyuan-video", "fp8")]


def joint_projection_model(name, joint):
    model, inputs, _ = TINY[name](torch.bfloat16)
    if joint == "fused":
        model.fuse_qkv_projections()
    integration.apply(model, quantize="fp8" if joint == "fp8" else None)
    return model, inputs


@pytest.mark.parametrize(("name", "joint"), JOINT_PROJECTIONS)
def test_grad_mode_with_a_joint_projection_gives_the_no_grad_output(name, joint):
    """In grad mode the in-place ops run their reference math under autograd, which refuses
    writes into chunks of one projection: they get copies of q and k there (patching.writable).
    The output is the no_grad one bit for bit: the same math on the same values on CPU, only
    recorded for autograd."""
    model, inputs = joint_projection_model(name, joint)
    expected = run(model, inputs)
    sample = model(**inputs, return_dict=False)[0]
    assert sample.requires_grad and torch.equal(sample, expected)


# diffusers rounds Kandinsky 5's q and k to bfloat16: one float32 ulp of difference before the rounding
# can move them a whole bfloat16 step, so its gradients differ more
GRADIENT_TOLERANCE = {"kandinsky5": 1e-4}


@pytest.mark.parametrize("name", sorted(TINY))
def test_grad_mode_gives_the_no_grad_output_and_diffusers_gradients(name):
    """float32, grad mode (training, LoRA fine-tuning, a call without no_grad): the patched
    model's output is its no_grad one bit for bit, and its backward gives diffusers' gradients.
    An in-place op into a projection whose other rows autograd saved fails there: HunyuanVideo's
    single blocks norm the text rows of the joint q and k, then write the video rows in place
    (they get copies with grad, patching.writable)."""
    model, inputs, _ = TINY[name](torch.float32)
    diffusers_model = copy.deepcopy(model)
    integration.apply(model)
    sample = output(model, inputs)
    assert sample.requires_grad and torch.equal(sample, run(model, inputs))
    expected = output(diffusers_model, inputs)
    # random weights: under a plain sum, gradients that cancel (a softmax row sums to 1) would compare ~0 with ~0
    weights = torch.randn(sample.shape, generator=torch.Generator().manual_seed(2))
    (sample * weights).sum().backward()
    (expected * weights).sum().backward()
    got = {path: p.grad for path, p in model.named_parameters() if p.grad is not None}
    want = {path: p.grad for path, p in diffusers_model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    tolerance = GRADIENT_TOLERANCE.get(name, TOLERANCE[torch.float32])
    largest = max(gradient.abs().max() for gradient in want.values())
    for path, gradient in want.items():  # atol from the largest: some gradients are ~0 (keys' biases)
        torch.testing.assert_close(got[path], gradient, atol=10 * tolerance * largest, rtol=10 * tolerance, msg=path)
    error = sum((got[path] - gradient).square().sum() for path, gradient in want.items()).sqrt()
    assert error / sum(gradient.square().sum() for gradient in want.values()).sqrt() <= tolerance


@pytest.mark.parametrize("name", sorted(TINY))
def test_an_fp8_model_in_grad_mode_gives_the_no_grad_output_and_refuses_backward(name):
    """FP8 layers are for inference: in grad mode a quantised model's output is its no_grad one
    bit for bit, and a backward through it raises an error that says so (without the mark, a
    gradient reaching an FP8 tensor fails inside autograd naming only a missing FP8 kernel)."""
    model, inputs, _ = TINY[name](torch.float32)
    integration.apply(model, quantize="fp8")
    sample = output(model, inputs)
    assert sample.requires_grad and torch.equal(sample, run(model, inputs))
    with pytest.raises(NotImplementedError, match=r"for inference and have no backward: run the model under "
                                                  r"torch.no_grad\(\)"):
        sample.sum().backward()


def test_compiled_fp8_flux_block_in_grad_mode_matches_eager_and_refuses_backward():
    """A double block of FP8 FLUX (joint FP8 q/k/v in both streams) under torch.compile(fullgraph=True)
    in grad mode, within the FP8 compile tolerance of test_fp8.py, and a backward through it raises
    the eager call's error; under no_grad its graph holds no copy of q and k."""
    model, inputs = joint_projection_model("flux", "fp8")
    block = model.transformer_blocks[0]
    arguments, keywords = model_runs.block_call(model, inputs, block)
    torch._dynamo.reset()
    with torch.no_grad():
        assert ".clone(" not in torch._dynamo.explain(block)(*arguments, **keywords).graphs[0].code
    eager = block(*arguments, **keywords)
    compiled = torch.compile(block, fullgraph=True)(*arguments, **keywords)
    for got, want in zip(compiled, eager):
        assert got.requires_grad and (got.float() - want.float()).norm() / want.float().norm() < 0.05
    with pytest.raises(NotImplementedError, match=r"for inference and have no backward: run the model under "
                                                  r"torch.no_grad\(\)"):
        sum(output.float().sum() for output in compiled).backward()
