"""Lower both Triton kernels to Triton IR for sm_90 on the host (no GPU), in a process of its
own: tests/model/test_triton_batch_invariant.py::test_kernels_lower_to_triton_ir_for_hopper
runs `python triton_lowering.py` with the interpreter off (triton cannot switch modes once its
language modules are imported).

torch is never imported here: the kernels' module (tokenweir/model/backends/_triton_kernel.py,
which imports triton alone) is loaded from its file, under its own name, without its package,
whose __init__ imports torch (~2 s of the child's ~3 s). Its code, and `jit_for_mode`, are the
ones the backends jit the kernels with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "tokenweir" / "model" / "backends" / \
    "_triton_kernel.py"
TTIR_TYPES = {"ptr": "*bf16", "table": "*i32", "scale": "fp32", "int": "i32"}
TTIR_CONSTANTS = dict(KV_HEADS=3, GROUP=3, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_M=16,
                      BLOCK_Q=5, BLOCK_N=32, BLOCK_K=32, F32_DOT=False, SUM_DOT=False)


def kernels_module():
    """tokenweir.model.backends._triton_kernel, loaded from its file without its package."""
    name = "tokenweir.model.backends._triton_kernel"
    spec = importlib.util.spec_from_file_location(name, KERNELS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def ttir_signature(jitted):
    """Each parameter as the JIT would type it: constexpr where the function's own params say
    so (from its tl.constexpr annotations), else a pointer, an int32 or the float scale."""
    signature, constants = {}, {}
    for i, p in enumerate(jitted.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[(i,)] = TTIR_CONSTANTS[p.name]
        elif p.name.endswith("_ptr"):
            kind = "table" if p.name.startswith(("block", "seq", "query", "tile")) else "ptr"
            signature[p.name] = TTIR_TYPES[kind]
        else:
            signature[p.name] = TTIR_TYPES["scale" if p.name == "scale" else "int"]
    return signature, constants


def lower_both_kernels() -> int:
    """Prints one line per kernel lowered; exit status 3 (and why) where triton's CUDA back
    end cannot be imported."""
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
    except (ImportError, RuntimeError) as exc:
        print(f"triton's CUDA back end is not importable here: {exc}")
        return 3
    K = kernels_module()
    options = backend.parse_options({})
    for source in (K.paged_attention_kernel, K.invariant_matmul_kernel):
        jitted = K.jit_for_mode(source)
        signature, constants = ttir_signature(jitted)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = ASTSource(fn=jitted, signature=signature, constexprs=constants).make_ir(
            target, options, backend.get_codegen_implementation(options),
            backend.get_module_map(), context)
        print(source.__name__, "tt.func" if "tt.func" in str(module) else "no function")
    return 0


if __name__ == "__main__":
    sys.exit(lower_both_kernels())
