"""The offline engine and its vLLM-shaped API: ``LLM(model=..., target="cpu").generate(prompts, SamplingParams())``.

One engine step (nano-vllm's ``LLMEngine.step``): hand the batch scheduled last time to the executor, schedule
the next batch while it runs (a worker thread; ``overlap=False`` does the same work in order), then process the
step's samples: append tokens, detokenize, check stops, free what finished.

Bad input is answered per request, never by failing the batch: an empty prompt, a prompt that does not fit
``max_model_len``, token ids outside the vocabulary, bad sampling parameters (max_tokens <= 0, an unknown stop
type, ...) give that request an output with ``finish_reason="error"`` and the message in ``error``; the other
requests run normally. Engine-level problems (no plan there, a plan for another target) raise a one-line
DeepInferError from ``LLM(...)``.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deepinfer.errors import DeepInferError, NotBuiltError
from deepinfer.runtime.executor import Executor, InterpreterRunner
from deepinfer.runtime.kv_cache import KVCacheManager, cache_specs, default_block_size
from deepinfer.runtime.plan import Plan, bind_weights, load_plan
from deepinfer.runtime.sampler import InvalidRequestError, Sample, SamplingParams
from deepinfer.runtime.scheduler import Batch, Scheduler, SchedulerConfig
from deepinfer.runtime.sequence import Sequence, Status

RUNTIME_TARGETS = ("cpu", "sm90")  # sm90: runtime/cuda_executor.py (needs a CUDA device)


@dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the plan's kernels' (compile --max-model-len), else
    #                                   min(the model's max positions, 4096)
    num_blocks: int | None = None  # default: enough for max_num_seqs sequences of max_model_len, within kv_cache_bytes
    kv_cache_bytes: int = 1 << 30  # the default num_blocks' memory cap for the block pools
    block_size: int | None = None  # default: kv_cache.default_block_size
    enable_prefix_caching: bool = True
    chunked_prefill: bool = True
    overlap: bool = True  # schedule step N+1 on a thread while step N runs
    seed: int = 0  # draws the seeds of requests that bring none
    cuda_graphs: bool = True  # sm90: decode steps replay CUDA graphs per batch-size bucket (runtime/cuda_graphs.py)
    # sm90: one batched step for all decoding sequences (the default; None: DEEPINFER_BATCHED_DECODE, on unless 0);
    # False: a chain of one-sequence steps (runtime/cuda_executor.py's CudaRunner)
    batched_decode: bool | None = None
    kv_cache_device: str | None = None  # None: the runner's device (cuda for sm90); "cpu": host-resident pools
    # sm90: build the kernels this engine looks up in this many processes before the first request (TileLang's disk
    # cache then serves every lookup; 0: each kernel builds at its first call, in the request's time)
    prebuild_jobs: int = 0
    # sm90 with cuda_graphs: capture every decode bucket's graph at start, on padding rows (None: on a CUDA device
    # unless DEEPINFER_GRAPH_WARMUP=0); False: each at its first use, inside the request that first fills it
    graph_warmup: bool | None = None


@dataclass
class RequestOutput:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list = field(default_factory=list)  # per token: (logprob, {token: logprob} top-n)
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed


def _resolve_plan(model, target: str, plan) -> Plan:
    if target not in RUNTIME_TARGETS:
        raise NotBuiltError(f"the runtime runs {', '.join(RUNTIME_TARGETS)} plans today; target {target!r} needs "
                            "its own executor")  # fmt: skip
    if target != "cpu":
        from deepinfer.runtime.cuda_executor import require_cuda

        require_cuda(f"target {target!r}")  # before compiling or loading anything: one line, no traceback
    if plan is None:
        from deepinfer.compiler import compile_model

        return compile_model(model, target).plan
    if not isinstance(plan, Plan):
        where, plan = plan, load_plan(plan)
    else:
        where = f"plan for {plan.model}"
    if plan.target != target:
        raise DeepInferError(f"{where} was compiled for {plan.target}; this runtime runs {target!r} plans")
    return plan


class LLM:
    """Generate from a compiled plan (or compile ``model`` in memory first)."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        target: str = "cpu",
        plan: Plan | str | os.PathLike | None = None,
        *,
        params: dict | None = None,
        tokenizer="auto",
        **engine_args,
    ):
        self.plan = _resolve_plan(model, target, plan)
        self.config = EngineConfig(**engine_args)
        if params is None:
            params, self.weights_source = bind_weights(self.plan)
        else:
            self.weights_source = "given"
        self.tokenizer = _load_tokenizer() if tokenizer == "auto" else tokenizer
        graph = self.plan.graph
        self.vocab_size = int(graph.outputs[0].shape[-1])
        self.eos_ids = _eos_ids(self.plan.config, self.tokenizer)
        self.max_model_len = self.config.max_model_len or plan_max_model_len(self.plan)
        if self.plan.target == "sm90" and self.config.prebuild_jobs > 0:
            prebuild_plan_kernels(self.plan, self.max_model_len, self.config.prebuild_jobs)
        compact = graph.meta.get("mode") == "compact"
        block_size = self.config.block_size or default_block_size(cache_specs(graph))
        num_blocks = self.config.num_blocks or self._default_num_blocks(cache_specs(graph), block_size)
        runner = _runner(self.plan, params, self.config, self.max_model_len)
        self.kv = KVCacheManager(
            graph, num_blocks, self.config.max_num_seqs, block_size,
            enable_prefix_caching=self.config.enable_prefix_caching and not compact,
            device=self.config.kv_cache_device or getattr(runner, "device", "cpu"),
        )  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.chunked_prefill,
                compact_keep_tokens=int(graph.meta["keep_tokens"]) if compact else None,
            ),
            self.kv,
        )  # fmt: skip
        self.executor = Executor(runner, self.kv)
        self.graph_warmup = _warm_up_decode_graphs(runner, self.kv.device, self.config)  # its log line, or None
        self._seed_rng = random.Random(self.config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._errors: list[Sequence] = []  # rejected at submission, reported on the next step
        self._aborts: list[str] = []
        self._next: Batch | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-step") if self.config.overlap else None
        self._counter = 0
        self.batch_log: list[list[tuple]] = []  # every executed batch's signature (tests compare them)

    def _default_num_blocks(self, specs, block_size: int) -> int:
        wanted = self.config.max_num_seqs * -(-self.max_model_len // block_size)
        per_block = sum(s.row_bytes * block_size // s.ratio for s in specs if s.growing) or 1
        return max(1, min(wanted, self.config.kv_cache_bytes // per_block))

    # -- requests ----------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None) -> str:
        """Queue one request; returns its id. A bad request is answered with finish_reason "error"."""
        params = params or SamplingParams()
        rid, index = str(self._counter), self._counter
        self._counter += 1
        ids: list[int] = []
        try:
            ids = self._prompt_ids(prompt)
            params.validate()
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            if not isinstance(seed, int):
                raise InvalidRequestError(f"seed must be an integer, got {seed!r}")
            seq = Sequence(rid, index, ids, params, seed, min(len(ids) + params.max_tokens, self.max_model_len))
            self._check_fits(seq)
        except DeepInferError as e:
            seq = Sequence(rid, index, ids, params, 0, 0)
            seq.status, seq.finish_reason, seq.error = Status.FINISHED, "error", str(e)
            seq.finish_time = time.perf_counter()
            self._errors.append(seq)
        else:
            self.scheduler.add(seq)
        self._seqs[rid] = seq
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step boundary (finish_reason "abort"); its cache is released."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._errors) or bool(self._aborts)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("messages", prompt.get("prompt")))
        if isinstance(prompt, str):
            ids = self._tok("a text prompt").encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._tok("a chat prompt").encode_chat(list(prompt))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError(f"a prompt is a string, a list of token ids or a list of chat messages, "
                                      f"got {type(prompt).__name__}")  # fmt: skip
        if not ids:
            raise InvalidRequestError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _tok(self, what: str):
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer; this engine has none (pass token ids)")
        return self.tokenizer

    def _check_fits(self, seq: Sequence) -> None:
        n = seq.num_prompt_tokens
        if n >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} (it must leave "
                                      "room for one generated token)")  # fmt: skip
        whole = not self.config.chunked_prefill or self.scheduler.config.compact_keep_tokens
        if whole and n > self.config.max_num_batched_tokens:
            raise InvalidRequestError(f"prompt has {n} tokens, over max_num_batched_tokens "
                                      f"{self.config.max_num_batched_tokens}, and it cannot be split here")  # fmt: skip
        if self.kv.blocks_for(seq.max_len) > self.kv.num_blocks:
            raise InvalidRequestError(f"request needs {self.kv.blocks_for(seq.max_len)} cache blocks; the cache has "
                                      f"{self.kv.num_blocks}")  # fmt: skip

    # -- stepping ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that changed (new token, finished)."""
        changed = self._apply_aborts_and_errors()
        batch = self._next if self._next is not None else self.scheduler.schedule()
        if self._pool is not None:
            running = self._pool.submit(self.executor.execute, batch)
            self._next = self.scheduler.schedule()
            samples = running.result()
        else:
            samples = self.executor.execute(batch)
            self._next = self.scheduler.schedule()
        self.batch_log.append(batch.signature())
        changed += self._process(batch, samples)
        return [self._output(s) for s in changed]

    def _apply_aborts_and_errors(self) -> list[Sequence]:
        changed, self._errors = self._errors, []
        for rid in self._aborts:
            seq = self._seqs.get(rid)
            if seq is not None and not seq.finished:
                self.scheduler.finish(seq, "abort")
                seq.finish_time = time.perf_counter()
                changed.append(seq)
        self._aborts = []
        return changed

    def _process(self, batch: Batch, samples: list) -> list[Sequence]:
        changed = []
        for item, sample in zip(batch.items, samples):
            seq = item.seq
            if item.stale:
                continue
            if isinstance(sample, Exception):
                self._finish(seq, "error", f"step failed: {sample}")
                changed.append(seq)
                continue
            self.kv.publish(seq.cache, seq.token_ids(), item.end)
            if item.samples:
                seq.num_inflight -= 1
                self._append(seq, sample)
                changed.append(seq)
        return changed

    def _append(self, seq: Sequence, sample: Sample) -> None:
        now = time.perf_counter()
        seq.first_token_time = seq.first_token_time or now
        seq.output_ids.append(sample.token)
        if seq.params.logprobs is not None:
            seq.logprobs.append((sample.logprob, sample.top_logprobs))
        p = seq.params
        stop_ids = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_ids)
        self._detokenize(seq)
        if sample.token in stop_ids:
            self._finish(seq, "stop")
        elif self._hit_stop_string(seq):
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= p.max_tokens or len(seq.token_ids()) >= seq.max_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        seq.error = error
        seq.finish_time = time.perf_counter()

    def _detokenize(self, seq: Sequence) -> None:
        # the whole output each time: simple, and right across multi-byte characters (O(n^2); fine offline)
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        hits = [(seq.text.find(s), s) for s in seq.params.stop_strings()]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        return True

    def _output(self, seq: Sequence) -> RequestOutput:
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        n = len(seq.output_ids)
        tpot = None
        if seq.finish_time and seq.first_token_time and n > 1:
            tpot = (seq.finish_time - seq.first_token_time) / (n - 1)
        return RequestOutput(
            seq.request_id, seq.index, list(seq.prompt_ids), list(seq.output_ids), seq.text, seq.finished,
            seq.finish_reason, seq.error, list(seq.logprobs), ttft, tpot, seq.num_preemptions, seq.num_cached_tokens,
        )  # fmt: skip

    # -- offline API -------------------------------------------------------------------------------------
    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield a request's output (cumulative) every time it gains a token or finishes."""
        self._submit(prompts, sampling_params)
        while self.has_unfinished():
            yield from self.step()
        self._check_drained()

    def generate(
        self, prompts, sampling_params=None, progress: Callable[[int, int], None] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts."""
        ids = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if progress:
                        progress(len(final), len(ids))
        self._check_drained()
        return [final[i] for i in ids]

    def _submit(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a string, a dict, or one list of token ids
        elif isinstance(prompts, list) and prompts and isinstance(prompts[0], dict) and "role" in prompts[0]:
            prompts = [prompts]  # one chat
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise DeepInferError(f"{len(prompts)} prompts but {len(params)} sampling params")
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]

    def _check_drained(self) -> None:
        # a scheduled-but-stale next batch may remain; it runs nothing, so drop it
        self._next = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def _runner(plan: Plan, params: dict, config: EngineConfig | None = None, max_model_len: int | None = None):
    """The plan's ModelRunner: the interpreter on cpu, compiled kernels (with counted fallbacks) on sm90."""
    if plan.target == "cpu":
        return InterpreterRunner(plan.graph, params)
    from deepinfer.runtime.cuda_executor import CudaRunner

    graphs = config.cuda_graphs if config is not None else True
    batched = config.batched_decode if config is not None else None  # runtime/batched_decode.py (the default)
    return CudaRunner(plan.graph, params, max_model_len=max_model_len, cuda_graphs=graphs, batched_decode=batched)


def _warm_up_decode_graphs(runner, kv_device, config: EngineConfig) -> str | None:
    """The runner's decode graphs captured now (CudaRunner.warm_up): with config.graph_warmup None, where they are
    CUDA graphs (a runner on a CUDA device: the stall it moves to the start exists there) unless the variable says
    0; with True, also on another device (tests: the emulated graph backend); never with False, nor where the
    executor will not decode through them (KV pools on another device: every item goes through forward). Returns
    the line it logged, or None."""
    from deepinfer.runtime.cuda_graphs import graph_warmup_from_env
    from deepinfer.runtime.executor import _same_device

    warm, device = getattr(runner, "warm_up", None), getattr(runner, "device", None)
    if warm is None or config.graph_warmup is False or not _same_device(kv_device, device):
        return None
    if config.graph_warmup is None and not (getattr(device, "type", None) == "cuda" and graph_warmup_from_env()):
        return None
    return warm()


def _load_tokenizer():
    try:
        from deepinfer.models.tokenizer import get_tokenizer

        return get_tokenizer()
    except DeepInferError:
        return None


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _eos_ids(config: dict, tokenizer) -> set[int]:
    eos = _text_config(config).get("eos_token_id", config.get("eos_token_id"))
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _max_positions(config: dict) -> int:
    return int(_text_config(config).get("max_position_embeddings", config.get("max_position_embeddings", 4096)))


def default_max_model_len(config: dict) -> int:
    """The engine's max_model_len when neither the caller nor the plan gives one."""
    return min(_max_positions(config), 4096)


def plan_max_model_len(plan: Plan) -> int:
    """The max_model_len the plan's kernels were built for (deepinfer compile --max-model-len; the caches' sizes,
    hence some kernels' shapes, follow it), else default_max_model_len."""
    return int((plan.kernels or {}).get("max_model_len") or default_max_model_len(plan.config))


PREBUILD_TIMEOUT_S = 1800.0  # a cold 40-layer V4.1 on 2 cores; past it the rest build lazily


def prebuild_plan_kernels(plan: Plan, max_model_len: int, jobs: int, log: Callable = print) -> dict:
    """Build, in `jobs` processes, the kernels an sm90 engine of this max_model_len looks up
    (plan_kernels.kernel_specs: the runtime adapters' own keys, read from the derived-key cache when compile
    derived them for the same graph and max_model_len), so the first request finds them in TileLang's disk cache.
    Returns {kernel: error} (those then build lazily or fall back, as before)."""
    from deepinfer.codegen.plan_kernels import kernel_specs
    from deepinfer.runtime.kernel_adapters import prebuild

    t0 = time.perf_counter()
    specs, _ = kernel_specs(plan.graph, "sm90", "bound", max_model_len=max_model_len)
    log(f"pre-building {len(specs)} kernels (max_model_len {max_model_len}; keys in {time.perf_counter() - t0:.1f} s)")
    return prebuild([s.key for s in specs], jobs, PREBUILD_TIMEOUT_S, log=log)
