"""The samplers of `xtcache generate`: transformers (seeded, reproducible) and vLLM (fast).

Both return, per prompt, `--samples-per-prompt` `Completion`s: the sampled ids (with the stop token
when the completion stopped), each id's log-prob under the sampling policy (log_softmax of the
logits divided by the temperature, restricted to the top-p nucleus and renormalised), and the stop
reason.

* `HfSampler`: a KV-cached decoding loop over the model's forward; each (prompt, sample) draws from
  its own `torch.Generator` seeded by `rollouts.sample_seed(--seed, prompt id, sample)`, so the same
  checkpoint and seed give the same rollouts, whatever the sharding or a resume.
* `VllmSampler`: token-id prompts with `logprobs=0` (the sampled token's log-prob, in vLLM's flat
  lists), `detokenize=False` (the text is decoded once per completion) and
  `logprobs_mode="processed_logprobs"` (after temperature and top-p); `stream` keeps the next part's
  requests queued in the engine while a part finishes and is written. On CUDA each sample is one
  request with its own seed `sample_seed(...)`; on the CPU build a per-request seed kills the engine
  ("CPU Generator does not use offset"), so there only the engine seed is set and two runs differ:
  that is logged, and the manifest records `reproducible: false`. On CUDA the rollouts are recorded as
  reproducible only with `VLLM_BATCH_INVARIANT=1` (without it a request's logits depend on its batch).

    python -c "import stage1_teacher.onpolicy.samplers as s; help(s.processed_logprobs)"
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque

from stage1_teacher.capture.hf_engine import DTYPES
from stage1_teacher.capture.vllm_engine import VllmOptions, on_cuda
from stage1_teacher.onpolicy.rollouts import Completion, Prompt, sample_seed
from xtcache.devices import compute_device
from xtcache.reaper import guard_children

log = logging.getLogger(__name__)


def processed_logprobs(logits, temperature: float, top_p: float):
    """log-probs of the sampling policy: log_softmax(logits / T), with the tokens outside the top-p
    nucleus (the smallest set of most probable tokens whose mass reaches top_p) set to -inf and the
    rest renormalised. logits: [B, V] float -> [B, V]."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # [B, V]
    drop_sorted = mass_before >= top_p  # the first token is always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def stop_ids(tokenizer, generation_eos) -> set[int]:
    """The ids that end a completion: the tokenizer's EOS and the generation config's EOS ids."""
    ids = set()
    for x in (tokenizer.eos_token_id, generation_eos):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, (list, tuple)):
            ids.update(int(i) for i in x)
    return ids


class HfSampler:
    """transformers model, one prompt at a time, its samples as one batch (same length: no padding)."""

    name = "hf"
    reproducible = True

    def __init__(self, student: str, tokenizer, *, dtype: str = "auto"):
        import torch
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
        self.device = compute_device()
        torch_dtype = getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(
            student, dtype=torch_dtype, trust_remote_code=False, use_safetensors=True).to(self.device).eval()
        self.stop = stop_ids(tokenizer, self.model.generation_config.eos_token_id)

    def sample(self, prompts: list[Prompt], sampling) -> list[list[Completion]]:
        return [self._one(p, sampling) for p in prompts]

    def stream(self, parts, sampling):
        """(part, prompts, completions) of each (part, prompts) of `parts`, one part after the other."""
        for part, prompts in parts:
            yield part, prompts, self.sample(prompts, sampling)

    def _one(self, prompt: Prompt, s) -> list[Completion]:
        import torch

        n = s.samples_per_prompt
        gens = [torch.Generator().manual_seed(sample_seed(s.seed, prompt.prompt_id, i)) for i in range(n)]
        ids = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        reason = ["length"] * n
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([prompt.token_ids] * n, device=self.device), use_cache=True)
            for step in range(s.max_new_tokens):
                logp = processed_logprobs(out.logits[:, -1], s.temperature, s.top_p).cpu()  # [n, V]
                nxt = []
                for r in range(n):
                    if reason[r] == "stop":
                        nxt.append(ids[r][-1])  # a finished row feeds its stop token; its output is ignored
                        continue
                    t = int(torch.multinomial(logp[r].exp(), 1, generator=gens[r]))
                    ids[r].append(t)
                    lps[r].append(float(logp[r, t]))
                    if t in self.stop:
                        reason[r] = "stop"
                    nxt.append(t)
                if all(x == "stop" for x in reason) or step == s.max_new_tokens - 1:
                    break
                out = self.model(input_ids=torch.tensor(nxt, device=self.device)[:, None],
                                 past_key_values=out.past_key_values, use_cache=True)
        return [Completion(ids[r], lps[r], reason[r]) for r in range(n)]

    def close(self) -> None:
        self.model = None


class VllmSampler:
    """One `vllm.LLM` for the whole job; every prompt of a part in one `generate` call."""

    name = "vllm"

    def __init__(self, student: str, tokenizer, *, dtype: str = "auto", gpu_memory_utilization: float | None = None,
                 seed: int = 0):
        from vllm import LLM

        self.seeded = on_cuda()  # one seed per (prompt, sample) request
        # the same draws run to run also need batch-invariant kernels: a request's logits otherwise depend on
        # which other requests share its batch (vLLM's VLLM_BATCH_INVARIANT=1)
        self.reproducible = self.seeded and os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
        if self.seeded and not self.reproducible:
            log.info("vLLM on CUDA: each sample has its own seed, but without VLLM_BATCH_INVARIANT=1 its logits may "
                     "change with the batch it runs in, so the rollouts are recorded as not reproducible")
        if not self.seeded:
            log.warning("vLLM on CPU: a per-request seed stops the CPU engine ('CPU Generator does not use offset'), "
                        "so only the engine seed is set and two runs draw different rollouts; --engine hf samples "
                        "reproducibly")
        kw = VllmOptions(model=student, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                         seed=seed).llm_kwargs()
        log.info("starting vLLM for %s", student)
        with guard_children():
            self.llm = LLM(**kw, logprobs_mode="processed_logprobs")
        self.stop = stop_ids(tokenizer, self.llm.llm_engine.model_config.hf_config.eos_token_id)

    def requests(self, prompts: list[Prompt], s):
        """The token-id prompts and their `SamplingParams` that `sample` sends to `LLM.generate`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # the sampled token's log-prob in flat lists (no dict per position), no text: `completion_text` decodes once
        common = dict(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens, logprobs=0,
                      flat_logprobs=True, detokenize=False)
        reqs, params = [], []
        for p in prompts:
            if self.seeded:
                for i in range(s.samples_per_prompt):
                    reqs.append(TokensPrompt(prompt_token_ids=p.token_ids))
                    params.append(SamplingParams(n=1, seed=sample_seed(s.seed, p.prompt_id, i), **common))
            else:
                reqs.append(TokensPrompt(prompt_token_ids=p.token_ids))
                params.append(SamplingParams(n=s.samples_per_prompt, **common))
        return reqs, params

    def sample(self, prompts: list[Prompt], sampling) -> list[list[Completion]]:
        reqs, params = self.requests(prompts, sampling)
        return self._grouped(self.llm.generate(reqs, params, use_tqdm=False), sampling)

    def stream(self, parts, sampling, ahead: int = 1):
        """(part, prompts, completions) of each (part, prompts) of `parts`, in order. The requests of
        the next `ahead` parts wait in the engine's queue while a part finishes and while the caller
        writes it, so the engine does not run dry at a part's end (the engine core runs in its own
        process: it keeps generating while this process writes). One `LLM.generate` per part would
        leave the engine with a shrinking batch at each part's end and idle during each write."""
        engine = self.llm.llm_engine
        queued: deque = deque()  # (part, prompts, request ids), oldest first
        finished: dict[str, object] = {}  # request id -> its final RequestOutput
        parts = iter(parts)

        def submit() -> None:
            for part, prompts in itertools.islice(parts, 1):
                queued.append((part, prompts, self._enqueue(*self.requests(prompts, sampling))))

        for _ in range(1 + ahead):
            submit()
        while queued:
            part, prompts, ids = queued[0]
            missing = sum(i not in finished for i in ids)
            while missing:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM finished without the outputs of part {part}")
                done = [o for o in engine.step() if o.finished]  # FINAL_ONLY: most steps return none
                if done:
                    finished.update((o.request_id, o) for o in done)
                    missing = sum(i not in finished for i in ids)
            queued.popleft()
            yield part, prompts, self._grouped([finished.pop(i) for i in ids], sampling)
            submit()  # after the caller committed the part: a bad row further on costs no finished part

    def _enqueue(self, reqs, params) -> list[str]:
        """Queue the requests without running the engine; their ids as the RequestOutputs carry them.
        `LLM` numbers its requests from its `request_counter` (what `LLM.generate` sorts its
        outputs by); a vLLM that numbers them otherwise is refused here, not mismatched later."""
        first = self.llm.request_counter.counter
        self.llm.enqueue(reqs, params, use_tqdm=False)
        if self.llm.request_counter.counter != first + len(reqs):
            raise RuntimeError("this vLLM does not number LLM.enqueue's requests from LLM.request_counter; "
                               "generate --engine vllm needs vllm 0.32's LLM")
        return [str(first + i) for i in range(len(reqs))]

    def _grouped(self, outs, sampling) -> list[list[Completion]]:
        """The completions of each prompt, from the RequestOutputs of `requests` (in their order)."""
        flat = [self._completion(o) for out in outs for o in out.outputs]
        n = sampling.samples_per_prompt
        return [flat[i * n:(i + 1) * n] for i in range(len(flat) // n)]

    @staticmethod
    def _completion(o) -> Completion:
        from vllm.logprobs import FlatLogprobs

        ids = [int(t) for t in o.token_ids]
        got = o.logprobs if o.logprobs is not None else []
        if isinstance(got, FlatLogprobs) and got.token_ids == ids and len(got.logprobs) == len(ids):
            lps = [float(x) for x in got.logprobs]  # logprobs=0: one entry per position, the sampled token's
        else:
            lps = [float(step[t].logprob) for t, step in zip(ids, got)]
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} sampled tokens")
        return Completion(ids, lps, "stop" if o.finish_reason == "stop" else "length")

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # a dead engine has nothing left to shut down
                log.debug("vLLM shutdown: %s", e)
