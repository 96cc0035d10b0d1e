"""What the CUDA and ROCm backends share: the kernels of ditops/csrc and how each op launches
them. A backend supplies a launcher (compile or load an instance, launch it on the current
stream); everything else, from launch shapes to argument packing, is written once here.

Who may call these (devices, dtypes, alignment, sizes) is in configs/registry.yaml: the
kernels need 16-byte aligned pointers and strides, D and Dh multiples of 8, and R a multiple
of 16, and the code below assumes the dispatcher checked that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import struct
import threading
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import yaml

from .. import kernel_cache
from ..dispatch.signature import pointer_index
from ..dispatch.contract import Kernel
from ..dispatch.device import MAX_GRID_Y, device_of, multiprocessors, warp_size_of
from .views import modulation, rows_of, tokens_of

SOURCES = Path(__file__).resolve().parents[1] / "csrc"
LAUNCH_FILE = Path(__file__).resolve().parents[1] / "configs" / "compiled_launch.yaml"

# Activation dtypes as template arguments; parameter dtypes as the run-time codes of memory.cuh.
C_TYPES = {torch.float32: "float", torch.float16: "float16", torch.bfloat16: "bfloat16"}
FP8_TYPES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e4m3fnuz: "float8_e4m3fnuz"}  # fp8.cuh
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CHUNK = 8  # elements per thread access (kChunk in memory.cuh)
MIN_ROW_BLOCK = 128


class Instance(NamedTuple):
    """One template instance of a kernel: what is compiled, loaded and launched."""

    source: str  # file in ditops/csrc
    kernel: str
    template_arguments: tuple
    block: int  # threads per block, also a template argument
    group: int  # threads per row (row kernels) or per head (rotary): a block holds block // group of them
    shared: int = 0  # bytes of dynamic shared memory a block takes

    @property
    def name_expression(self) -> str:
        return f"{self.kernel}<{', '.join(str(a) for a in self.template_arguments)}>"


@functools.lru_cache(maxsize=None)
def _launch_settings() -> dict:
    return yaml.safe_load(LAUNCH_FILE.read_text())


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """Hash of every kernel source and header: any change recompiles every instance."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES.glob("*.cu*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def divisor(d: int) -> tuple:
    """The Divisor struct of memory.cuh for d: (multiplier, shift) such that ((2 * n * multiplier)
    >> 32) >> shift == n // d for every 0 <= n < 2**31 (Granlund and Montgomery: shift =
    ceil(log2 d), multiplier = ceil(2**(31 + shift) / d) < 2**32)."""
    shift = (d - 1).bit_length()
    return (-(-(1 << (31 + shift)) // d), shift)


def _row_layout(name: str, dtype: torch.dtype, hidden: int) -> tuple:
    """(threads per row, chunks, block, min_blocks) of the first row class with max_hidden >= D;
    name: the kernel's key in the class's min_blocks and layouts (a kernel's own threads and
    chunks, where they differ from the class's)."""
    for entry in _launch_settings()["rows"]:
        if hidden <= entry["max_hidden"]:
            layout = entry.get("layouts", {}).get(name, entry)
            threads, chunks = layout["row_threads"], layout["chunks"]
            # float32 rows take twice the registers: capped as tightly, they spill
            min_blocks = entry.get("min_blocks", {}).get(name, 1) if dtype != torch.float32 else 1
            return threads, chunks, max(threads, MIN_ROW_BLOCK), min_blocks
    raise ValueError(f"no compiled launch setting for rows of {hidden}; the registry's max_hidden_size should refuse them")


def row_instance(kernel: str, dtype: torch.dtype, param_dtype: torch.dtype, hidden: int, affine: bool,
                 fp8_dtype: Optional[torch.dtype] = None) -> Instance:
    """A row kernel for activations of dtype and weights/modulation of param_dtype, in the
    layout of the first row class with max_hidden >= D; affine: the call has a norm weight or
    bias. That is a template flag, not a run-time test like the kernels' other options,
    because registers are allocated for a kernel's every path: preloaded weight and bias
    (row_tile.cuh) in an instance that never uses them cost registers, and so occupancy, on
    the calls without an affine (FLUX.2, HunyuanVideo). fp8_dtype: y in that FP8 format, its
    min_blocks the launch table's ``<kernel>_fp8``. The last template argument is y's type
    (x's, or the FP8 format), always spelled out: hiprtc finds an instance by its arguments'
    spelling, and a default argument has none."""
    threads, chunks, block, min_blocks = _row_layout(kernel + ("_fp8" if fp8_dtype else ""), dtype, hidden)
    arguments = (C_TYPES[dtype], C_TYPES[param_dtype], "true" if affine else "false", threads, chunks, block, min_blocks,
                 FP8_TYPES[fp8_dtype] if fp8_dtype else C_TYPES[dtype])
    return Instance(f"{kernel}.cu", kernel, arguments, block, threads)


def quantize_instance(dtype: torch.dtype, fp8_dtype: torch.dtype, gelu: bool, hidden: int,
                      prefix: bool = False) -> Instance:
    """The row_quantize kernel (quantize_fp8) for activations of dtype, in the row classes'
    layouts; hidden: a row's width, P + D with a prefix. prefix: a template flag, so that the
    calls without one run the kernel they ran before it existed."""
    threads, chunks, block, min_blocks = _row_layout("row_quantize", dtype, hidden)
    arguments = (C_TYPES[dtype], FP8_TYPES[fp8_dtype], "true" if gelu else "false", "true" if prefix else "false",
                 threads, chunks, block, min_blocks)
    return Instance("row_quantize.cu", "row_quantize", arguments, block, threads)


STREAM_TYPES = (torch.float16, torch.bfloat16)  # the stream kernel's rows' dtypes


def stream_instance(dtype: torch.dtype, param_dtype: torch.dtype, fp8_dtype: torch.dtype, rms: bool, entry: dict,
                    hidden: int) -> Instance:
    """The modulated_norm_stream kernel (norm_scale_shift_fp8 on a persistent grid) of a launch
    table entry for rows of D = hidden (rms: RMSNorm's instance): row_warps warps a row, each
    thread holding the chunks of 8 values that rows of up to max_hidden take (the instance for D
    of exactly that many: WHOLE); its dynamic shared memory holds each of the block's row groups'
    ring of `stages` rows, and the modulation where it is not held in registers."""
    threads = entry["row_warps"] * warp_size_of("cuda")  # the stream kernel runs on NVIDIA alone
    chunks = -(-entry["max_hidden"] // (CHUNK * threads))
    in_registers, whole = entry["modulation_in_registers"], hidden == threads * chunks * CHUNK
    flag = {False: "false", True: "true"}
    arguments = (C_TYPES[dtype], C_TYPES[param_dtype], FP8_TYPES[fp8_dtype], flag[rms], entry["row_warps"], entry["groups"],
                 chunks, entry["stages"], flag[in_registers], flag[whole], entry["blocks_per_sm"])
    row_chunks = threads * chunks
    shared = 16 * row_chunks * (entry["groups"] * entry["stages"] + (0 if in_registers else 4))
    return Instance("modulated_norm_stream.cu", "modulated_norm_stream", arguments, threads * entry["groups"], threads, shared)


def stream_entry(x: torch.Tensor, modulations: tuple, affine: bool, fp8_dtype: torch.dtype) -> Optional[dict]:
    """The launch table's modulated_norm_stream entry for an FP8 norm call on x's device, or None
    where there is none or the call is not one the kernel takes: 16-bit x, no norm weight or bias,
    every modulation (views.modulation's tuple) one vector per batch item or one for all (no
    stride over tokens), at most MAX_GRID_Y batch items, y in e4m3fn (NVIDIA's FP8 format)."""
    shape = rows_of(x)
    if x.dtype not in STREAM_TYPES or affine or shape.batch > MAX_GRID_Y or fp8_dtype != torch.float8_e4m3fn:
        return None
    if any(m[2] != 0 for m in modulations):  # group_stride: the modulation varies over tokens
        return None
    name = device_of(x.get_device()).name
    for device, entries in _launch_settings().get("modulated_norm_stream", {}).items():
        if device in name:
            return next((entry for entry in entries if shape.hidden <= entry["max_hidden"]), None)
    return None


def stream_instances() -> list:
    """Every instance of the stream kernel its launch table names (NVIDIA devices alone): per
    entry, the one for rows of max_hidden values and the one for narrower rows."""
    entries = [entry for table in _launch_settings().get("modulated_norm_stream", {}).values() for entry in table]
    return list(dict.fromkeys(stream_instance(dtype, param_dtype, torch.float8_e4m3fn, rms, entry, hidden)
                              for entry, dtype, param_dtype, rms in itertools.product(entries, STREAM_TYPES, C_TYPES, (False, True))
                              for hidden in (entry["max_hidden"], entry["max_hidden"] - CHUNK)))


def rotary_instance(dtype: torch.dtype, head_size: int, interleaved: bool, streaming: bool = False,
                    layer: bool = False, head_cache: bool = False) -> Instance:
    """The rotary kernel for heads of head_size in one pair layout: a thread per chunk of a head
    (interleaved: its pairs lie in a chunk) or per two chunks (NeoX: a pair's values lie R/2
    apart), in groups as wide as still pack the most heads into a 32-lane segment (rotary.cu).
    Interleaved: 16 lanes for Dh 96 (two heads), 10 for Dh 80 (three); NeoX: 6 (five heads) and
    5 (six). streaming: the instance that stores q and k with the streaming cache hint
    (_streaming_stores says for which calls). layer: the LayerNorm instance (qk_norm_rope_'s
    norm="layer"). head_cache: the instance reading a cos/sin row per head."""
    settings = _launch_settings()["rotary"]
    chunks = -(-head_size // (CHUNK if interleaved else 2 * CHUNK))  # a lane's share of the head
    threads, block = SEGMENT // (SEGMENT // chunks), settings["block"]
    arguments = (C_TYPES[dtype], "true" if interleaved else "false", threads, block, _rotary_items(interleaved),
                 "true" if streaming else "false", settings["head_cache_min_blocks" if head_cache else "min_blocks"],
                 "true" if layer else "false", "true" if head_cache else "false")
    return Instance("rotary.cu", "rotary", arguments, block, threads)


def rotary_token_norm_instance(dtype: torch.dtype, interleaved: bool, hidden: int, layer: bool = False,
                               head_cache: bool = False) -> Instance:
    """The rotary_token_norm kernel (qk_norm_rope_ with norm_over="token"; layer: its LayerNorm
    instance; head_cache: the one reading a cos/sin row per head) for a token's widest tensor of
    hidden = H * Dh values: the first launch class with max_hidden >= hidden, a block per token
    and tensor holding block * items chunks of 8 values."""
    for entry in _launch_settings()["rotary_token_norm"]:
        if hidden <= entry["max_hidden"]:
            arguments = (C_TYPES[dtype], "true" if interleaved else "false", entry["block"], entry["items"],
                         "true" if layer else "false", "true" if head_cache else "false")
            return Instance("rotary.cu", "rotary_token_norm", arguments, entry["block"], entry["block"])
    raise ValueError(f"no compiled launch setting for token norms of {hidden}; the registry's max_hidden_size should refuse them")


def _rotary_items(interleaved: bool) -> int:
    """Heads a rotary thread takes (ITEMS): the launch table's, per pair layout."""
    return _launch_settings()["rotary"]["items"]["interleaved" if interleaved else "neox"]


def _streaming_stores(tokens: int) -> bool:
    """Whether a rotary call of this many tokens stores q and k with the streaming cache hint
    (the launch table's token range; a hint changes no result, so a token count may choose it)."""
    streamed = _launch_settings()["rotary"].get("streaming_stores")
    return streamed is not None and streamed["min_tokens"] <= tokens <= streamed["max_tokens"]


ROW_KERNELS = ("modulated_norm", "selected_modulation_norm", "gated_add_norm")
ROTARY_HEAD_SIZES = range(CHUNK, 256 + 1, CHUNK)  # every Dh the registry lets through (max_head_size)
SEGMENT = 32  # lanes the rotary kernel packs whole heads into (kSegment in portability.cuh)


def all_instances() -> list:
    """Every instance the registry can select: each kernel x activation dtype x parameter dtype x
    launch class x with or without an affine; the FP8 kernels in each FP8 format (either
    backend compiles both: e4m3fnuz runs in software on NVIDIA, fp8.cuh)."""
    instances = []
    rows = [entry["max_hidden"] for entry in _launch_settings()["rows"]]
    for dtype in C_TYPES:
        for param_dtype, kernel, hidden, affine in itertools.product(C_TYPES, ROW_KERNELS, rows, (False, True)):
            instances.append(row_instance(kernel, dtype, param_dtype, hidden, affine))
        for kernel, param_dtype, hidden, affine, fp8_dtype in itertools.product(ROW_KERNELS, C_TYPES, rows,
                                                                                (False, True), FP8_TYPES):
            instances.append(row_instance(kernel, dtype, param_dtype, hidden, affine, fp8_dtype))
        instances += [quantize_instance(dtype, fp8_dtype, gelu, hidden, prefix)
                      for fp8_dtype, gelu, hidden, prefix in itertools.product(FP8_TYPES, (False, True), rows, (False, True))]
        instances += [rotary_instance(dtype, head_size, interleaved, streaming, layer, head_cache)
                      for head_size, interleaved, streaming, layer, head_cache in itertools.product(
                          ROTARY_HEAD_SIZES, (False, True), (False, True), (False, True), (False, True))]
        instances += [rotary_token_norm_instance(dtype, interleaved, entry["max_hidden"], layer, head_cache)
                      for entry, interleaved, layer, head_cache in itertools.product(
                          _launch_settings()["rotary_token_norm"], (False, True), (False, True), (False, True))]
    return list(dict.fromkeys(instances))


class PackedArguments:
    """Kernel parameters as cuLaunchKernel and hipModuleLaunchKernel take them: the address of
    an array of pointers, one per parameter, to the parameter's bytes. A parameter is a tensor
    or None (a pointer), an int (long long), a float (float), or a tuple of tensors, None and
    ints (a struct of 64-bit fields, as in memory.cuh).

    Packed once per launch plan: ``rebind(pointers)`` then writes only the data pointers of
    a later call's tensors, at the places of this call's tensors (``values`` are a call's
    arguments and outputs, ``pointers`` the data pointers of the tensors among a call's
    values, in order; ``slots`` maps byte offsets to indices in them)."""

    def __init__(self, arguments: list, values: tuple = ()):
        layout, fields, offsets, size = ["<"], [], [], 0
        self.slots = []  # (byte offset, index in the call's values)
        for argument in arguments:
            offsets.append(size)
            for field in argument if isinstance(argument, tuple) else (argument,):
                if isinstance(field, float):
                    layout.append("f4x")
                    fields.append(field)
                elif isinstance(field, torch.Tensor):
                    layout.append("Q")
                    fields.append(field.data_ptr())
                    self.slots.append((size, pointer_index(values, field)))
                else:
                    layout.append("q")
                    fields.append(0 if field is None else int(field))
                size += 8
        self.buffer = ctypes.create_string_buffer(struct.pack("".join(layout), *fields), size)
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * len(offsets))(*(base + offset for offset in offsets))
        self.address = ctypes.addressof(self.pointers)

    @property
    def rebindable(self) -> bool:
        """Whether every tensor parameter is one of the call's values, at one place."""
        return all(index is not None for _, index in self.slots)

    def rebind(self, pointers: tuple) -> int:
        for offset, index in self.slots:
            _pack_pointer(self.buffer, offset, pointers[index])
        return self.address


_pack_pointer = struct.Struct("<Q").pack_into


class Binary(NamedTuple):
    code: bytes  # a cubin or an AMD code object
    lowered_name: bytes  # the instance's mangled name in it
    compiled: bool  # False: read from the disk cache


def cached_binary(backend: str, compiler_version: str, arch: str, instance: Instance,
                  compile: Callable[[], tuple]) -> Binary:
    """The instance's binary for arch from the disk cache (ditops/kernel_cache.py), or
    compile() -> (code, lowered name) on a miss. The key holds everything the binary
    depends on: the sources, the compiler's version, the arch and the instance."""
    compiled = []

    def entry() -> bytes:
        code, lowered_name = compile()
        compiled.append(True)
        return lowered_name.encode() + b"\0" + code

    key = (backend, source_hash(), compiler_version, arch, instance.source, instance.name_expression)
    lowered, _, code = kernel_cache.cached_binary(key, entry).partition(b"\0")
    return Binary(code, lowered, bool(compiled))


class CompiledLaunch(NamedTuple):
    instance: Instance
    grid: tuple
    arguments: list  # parameters as PackedArguments takes them


# A backend's two launch functions:
# launch(instance, grid, packed arguments, device index) -> None, on that device's current stream;
# bind(instance, device index) -> launch(grid, packed arguments address), the instance loaded once.
Launcher = Callable[[Instance, tuple, PackedArguments, int], None]
Binder = Callable[[Instance, int], Callable[[tuple, int], None]]


def _weight(t: Optional[torch.Tensor]) -> tuple:
    """The rotary kernels' Weight struct (a norm weight or bias): its dtype is a run-time value."""
    return (t, DTYPE_CODES[t.dtype]) if t is not None else (None, 0)


def _cos_sin_cache(t: torch.Tensor) -> tuple:
    """The rotary kernels' CosSinCache struct: [P, R] (one row for every head), or a row per head,
    [P, H, R] or [B, P, H, R] (B 1: one table for every batch item, batch stride 0)."""
    if t.dim() == 2:
        return (t, DTYPE_CODES[t.dtype], t.stride(0), 0, 0)
    batch_stride = t.stride(0) if t.dim() == 4 and t.shape[0] > 1 else 0
    return (t, DTYPE_CODES[t.dtype], t.stride(-3), batch_stride, t.stride(-2))


def _param_dtype(x: torch.Tensor, params: tuple) -> torch.dtype:
    """The one dtype of a row kernel's weights and modulation (registry: uniform_param_dtype)."""
    return next((t.dtype for t in params if t is not None), x.dtype)


def _rows(t: Optional[torch.Tensor]) -> tuple:
    if t is None:
        return (None, 0, 0)
    shape = rows_of(t)
    return (t, shape.batch_stride, shape.token_stride)


def _integers(t: Optional[torch.Tensor]) -> tuple:
    """An integer tensor [B, S] (or [T]) as the Integers struct of memory.cuh."""
    if t is None:
        return (None, 0, 0, 0)
    batch_stride, token_stride = (0, t.stride(0)) if t.dim() == 1 else t.stride()
    return (t, t.element_size(), batch_stride, token_stride)


class CompiledOps:
    """The ops of docs/ops.md as launches of the csrc kernels. ``<op>_launch`` takes the backend
    calling convention (the op's arguments, then the outputs to write) and returns the
    ``CompiledLaunch`` (None for an empty input); ``kernel(launch_of)`` makes the op's
    ``Kernel`` (dispatch/contract.py): run, and bind for ditops/ops.py's launch plans."""

    def __init__(self, launcher: Launcher, binder: Binder):
        self.launch, self.bind = launcher, binder

    def kernel(self, launch_of: Callable) -> Kernel:
        def run(*values):
            launch = launch_of(*values)
            if launch is not None:
                self.launch(launch.instance, launch.grid, PackedArguments(launch.arguments), values[0].get_device())

        def bind(values: tuple, device_index: int):
            launch = launch_of(*values)
            if launch is None:
                return lambda values, pointers: None
            packed = PackedArguments(launch.arguments, values)
            if not packed.rebindable:
                return None
            bound = self.bind(launch.instance, device_index)
            grid = launch.grid
            # Every call of the plan rewrites the one packed buffer: two threads between their
            # rebind and their launch would launch each other's pointers (8 threads on an H200
            # got 4 wrong results of 512). The driver copies the parameters at launch.
            lock = threading.Lock()

            def launch_bound(values: tuple, pointers: tuple) -> None:
                with lock:
                    bound(grid, packed.rebind(pointers))

            return launch_bound

        return Kernel(run, bind)

    def _rows_launch(self, kernel: str, x: torch.Tensor, params: tuple, arguments: list, norm_params: tuple,
                     fp8_dtype: Optional[torch.dtype] = None) -> Optional[CompiledLaunch]:
        """params: the weight and modulation tensors (their dtype is the kernel's P);
        norm_params: the norms' weights and biases, any of which makes the instance affine;
        fp8_dtype: y's FP8 format, None for y like x."""
        affine = any(t is not None for t in norm_params)
        return self._row_grid(kernel, x, arguments, lambda hidden: row_instance(
            kernel, x.dtype, _param_dtype(x, params), hidden, affine, fp8_dtype))

    def _row_grid(self, kernel: str, x: torch.Tensor, arguments: list, instance_of: Callable[[int], Instance],
                  prefix_width: int = 0) -> Optional[CompiledLaunch]:
        """A row kernel's launch over x's rows, each prefix_width + D values wide (quantize_fp8's
        prefix comes before x's columns): the instance for that width, a block's rows at a time."""
        shape = rows_of(x)
        rows, width = shape.batch * shape.tokens, prefix_width + shape.hidden
        if rows == 0 or width == 0:
            return None
        if rows >= 2**31:
            raise ValueError(f"{kernel}: B * S = {rows} rows; the compiled kernels index rows with 32 bits")
        instance = instance_of(width)
        rows_per_block = instance.block // instance.group
        grid = ((rows + rows_per_block - 1) // rows_per_block, 1, 1)
        return CompiledLaunch(instance, grid, arguments + [rows, shape.tokens, width])

    def _stream(self, x, scale, shift, weight, bias, norm, eps, modulation_index, y, y_scale,
                static_scale) -> Optional[CompiledLaunch]:
        """norm_scale_shift_fp8 on the stream kernel where its launch table takes the call
        (stream_entry; not empty, no modulation table), else None: blocks of `groups` row groups,
        all of one batch item (grid y), enough to keep blocks_per_sm on every SM, split over the
        batch items, but no more than give each group rows (the kernel deals a batch item's rows
        to the blocks first, then their groups)."""
        shape = rows_of(x)
        rows = shape.batch * shape.tokens
        if modulation_index is not None or not rows * shape.hidden or rows >= 2**31:
            return None  # >= 2^31: the kernel's 32-bit rows; modulated_norm refuses the call by name
        modulations = (modulation(scale, shape.tokens), modulation(shift, shape.tokens))
        entry = stream_entry(x, modulations, weight is not None or bias is not None, y.dtype)
        if entry is None:
            return None
        resident = entry["blocks_per_sm"] * multiprocessors(x)
        per_group = -(-rows // (resident * entry["groups"]))
        blocks = min(-(-resident // shape.batch), -(-shape.tokens // per_group))
        instance = stream_instance(x.dtype, _param_dtype(x, (scale, shift)), y.dtype, norm == "rms", entry, shape.hidden)
        arguments = [_rows(x), *modulations, y, y_scale, static_scale, float(eps), shape.tokens, shape.hidden]
        return CompiledLaunch(instance, (blocks, shape.batch, 1), arguments)

    def _modulated_norm(self, x, residual, gate, scale, shift, weight, bias, norm, eps, y, residual_out, y_scale=None,
                        static_scale=None):
        tokens = rows_of(x).tokens
        arguments = [_rows(x), _rows(residual), modulation(gate, tokens), modulation(scale, tokens),
                     modulation(shift, tokens), weight, bias, y, residual_out, y_scale, static_scale, float(eps),
                     int(norm == "rms")]
        return self._rows_launch("modulated_norm", x, (gate, scale, shift, weight, bias), arguments, (weight, bias),
                                 y.dtype if y_scale is not None else None)

    def norm_scale_shift_launch(self, x, scale, shift, weight, bias, norm, eps, modulation_index, y):
        return self._modulated_norm(x, None, None, scale, shift, weight, bias, norm, eps, y, None)

    def residual_norm_scale_shift_launch(self, x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index, y,
                                         residual_out):
        return self._modulated_norm(x, residual, gate, scale, shift, weight, bias, norm, eps, y, residual_out)

    def norm_scale_shift_fp8_launch(self, x, scale, shift, weight, bias, norm, eps, fp8_dtype, static_scale,
                                    modulation_index, y, y_scale):
        return (self._stream(x, scale, shift, weight, bias, norm, eps, modulation_index, y, y_scale, static_scale)
                or self._modulated_norm(x, None, None, scale, shift, weight, bias, norm, eps, y, None, y_scale, static_scale))

    def residual_norm_scale_shift_fp8_launch(self, x, residual, gate, scale, shift, weight, bias, norm, eps, fp8_dtype,
                                             static_scale, modulation_index, y, y_scale, residual_out):
        return self._modulated_norm(x, residual, gate, scale, shift, weight, bias, norm, eps, y, residual_out, y_scale,
                                    static_scale)

    def quantize_fp8_launch(self, x, activation, prefix, fp8_dtype, static_scale, y, y_scale):
        prefix_width = prefix.shape[-1] if prefix is not None else 0
        arguments = [_rows(x), _rows(prefix), prefix_width, y, y_scale, static_scale]
        return self._row_grid("row_quantize", x, arguments, lambda hidden: quantize_instance(
            x.dtype, y.dtype, activation == "gelu_tanh", hidden, prefix is not None), prefix_width)

    def _selected_modulation_norm(self, x, residual, residual_gate, index, modulations, weight, bias, eps,
                                  y, residual_out, gate_out, y_scale=None, static_scale=None):
        tokens = rows_of(x).tokens
        arguments = [_rows(x), _rows(residual), modulation(residual_gate, tokens), _integers(index),
                     *(modulation(t, tokens) for t in modulations), weight, bias, y, residual_out, gate_out, y_scale,
                     static_scale, float(eps)]
        return self._rows_launch("selected_modulation_norm", x, (residual_gate, *modulations, weight, bias), arguments,
                                 (weight, bias), y.dtype if y_scale is not None else None)

    def norm_scale_shift_select_launch(self, x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps,
                                       y, gate_out):
        modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
        return self._selected_modulation_norm(x, None, None, index, modulations, weight, bias, eps, y, None, gate_out)

    def residual_norm_scale_shift_select_launch(self, x, residual, residual_gate, index, scale0, shift0, gate0, scale1,
                                                shift1, gate1, weight, bias, eps, y, residual_out, gate_out):
        modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
        return self._selected_modulation_norm(x, residual, residual_gate, index, modulations, weight, bias, eps,
                                              y, residual_out, gate_out)

    def norm_scale_shift_select_fp8_launch(self, x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps,
                                           fp8_dtype, static_scale, y, y_scale, gate_out):
        modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
        return self._selected_modulation_norm(x, None, None, index, modulations, weight, bias, eps, y, None, gate_out,
                                              y_scale, static_scale)

    def residual_norm_scale_shift_select_fp8_launch(self, x, residual, residual_gate, index, scale0, shift0, gate0, scale1,
                                                    shift1, gate1, weight, bias, eps, fp8_dtype, static_scale, y, y_scale,
                                                    residual_out, gate_out):
        modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
        return self._selected_modulation_norm(x, residual, residual_gate, index, modulations, weight, bias, eps,
                                              y, residual_out, gate_out, y_scale, static_scale)

    def _gated_add_norm(self, x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y,
                        y_scale=None, static_scale=None):
        tokens = rows_of(x).tokens
        arguments = [_rows(x), _rows(branch), modulation(gate, tokens), modulation(scale, tokens),
                     weight, bias, weight2, bias2, out, y, y_scale, static_scale, float(eps), int(norm == "rms"),
                     int(gate_act == "tanh")]
        return self._rows_launch("gated_add_norm", x, (gate, scale, weight, bias, weight2, bias2), arguments,
                                 (weight, bias, weight2, bias2), y.dtype if y_scale is not None else None)

    def add_gate_norm_launch(self, x, branch, gate, weight, bias, norm, eps, gate_act, out):
        return self._gated_add_norm(x, branch, gate, None, weight, bias, None, None, norm, eps, gate_act, out, None)

    def add_gate_norm_scale_launch(self, x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act,
                                   out, y):
        return self._gated_add_norm(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y)

    def add_gate_norm_scale_fp8_launch(self, x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act,
                                       fp8_dtype, static_scale, y, y_scale, out):
        return self._gated_add_norm(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y,
                                    y_scale, static_scale)

    def _rotary(self, q, k, q_weight, k_weight, q_bias, k_bias, cos_sin_cache, positions, interleaved, eps,
                position_offset, norm):
        """norm: "rms" or "layer", None for RoPE alone."""
        q_tokens = tokens_of(q)
        q_heads, k_heads = q.shape[-2], (k.shape[-2] if k is not None else 0)
        rows = q_tokens.batch * q_tokens.tokens
        if rows == 0 or q_heads + k_heads == 0 or q.shape[-1] == 0:
            return None
        instance = rotary_instance(q.dtype, q.shape[-1], interleaved, _streaming_stores(rows), norm == "layer",
                                   cos_sin_cache.dim() > 2)
        # As rotary.cu numbers its slots: a token's q slots, then its k slots, `items` heads each.
        items = _rotary_items(interleaved)
        token_slots = (q_heads + items - 1) // items + (k_heads + items - 1) // items
        slots = rows * token_slots
        slots_per_block = instance.block // SEGMENT * (SEGMENT // instance.group)
        blocks = -(-slots // slots_per_block)
        if blocks * slots_per_block > 2**31:  # the last block's padding slots included (Divisor's range)
            raise ValueError(f"q: {rows} tokens make {blocks * slots_per_block} head slots with the last block's padding; "
                             f"the compiled rotary kernel wants fewer than 2**31")
        k_view = (k, *tokens_of(k)[2:]) if k is not None else (None, 0, 0)
        arguments = [
            (q, q_tokens.batch_stride, q_tokens.token_stride), k_view, _weight(q_weight), _weight(k_weight),
            _weight(q_bias), _weight(k_bias), _cos_sin_cache(cos_sin_cache),
            _integers(positions), q_heads, k_heads, q_tokens.tokens, divisor(q_tokens.tokens), divisor(token_slots), rows,
            q.shape[-1], cos_sin_cache.shape[-1], position_offset, float(eps), int(norm is not None),
        ]
        return CompiledLaunch(instance, (blocks, 1, 1), arguments)

    def _rotary_token_norm(self, q, k, q_weight, k_weight, q_bias, k_bias, cos_sin_cache, positions, interleaved, eps,
                           position_offset, norm):
        q_tokens = tokens_of(q)
        rows = q_tokens.batch * q_tokens.tokens
        if rows == 0:
            return None
        instance = rotary_token_norm_instance(q.dtype, interleaved, max(q.shape[-2], k.shape[-2]) * q.shape[-1],
                                              norm == "layer", cos_sin_cache.dim() > 2)
        arguments = [
            (q, q_tokens.batch_stride, q_tokens.token_stride), (k, *tokens_of(k)[2:]), _weight(q_weight), _weight(k_weight),
            _weight(q_bias), _weight(k_bias), _cos_sin_cache(cos_sin_cache),
            _integers(positions), q.shape[-2], k.shape[-2], q_tokens.tokens, q.shape[-1], cos_sin_cache.shape[-1],
            position_offset, float(eps),
        ]
        return CompiledLaunch(instance, (rows, 2, 1), arguments)

    def qk_norm_rope__launch(self, q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, rotary_dim, eps,
                             position_offset, norm_over, norm, q_bias, k_bias):
        if norm_over == "token":
            return self._rotary_token_norm(q, k, q_weight, k_weight, q_bias, k_bias, cos_sin_cache, positions, interleaved,
                                           eps, position_offset, norm)
        return self._rotary(q, k, q_weight, k_weight, q_bias, k_bias, cos_sin_cache, positions, interleaved, eps,
                            position_offset, norm)

    def rope__launch(self, q, k, cos_sin_cache, positions, interleaved, rotary_dim, position_offset):
        return self._rotary(q, k, None, None, None, None, cos_sin_cache, positions, interleaved, 0.0, position_offset,
                            norm=None)
