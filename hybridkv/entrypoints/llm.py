"""`LLM(model=..., **config).generate(prompts, sampling_params)`: offline batched generation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from hybridkv.engine import Engine
from hybridkv.entrypoints.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    normalise_messages,
    template_variables,
)
from hybridkv.outputs import RequestOutput
from hybridkv.sampling_params import SamplingParams, choice_seed
from hybridkv.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Keyword arguments are the fields of ModelConfig (dtype, device, seed, quantization),
    CacheConfig (allocation, kernel_block_size, enable_prefix_caching, memory_bytes, ...),
    SchedulerConfig (max_num_seqs, max_num_batched_tokens, max_model_len) and ParallelConfig
    (tensor_parallel_size, distributed_timeout_s: the LLM starts the other ranks itself)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = Engine(model, **kwargs)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks now (else when the LLM is collected or the
        program ends); a single-process LLM has nothing to stop."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or None for a checkpoint without tokenizer.json (token-id
        mode, like vLLM's `skip_tokenizer_init`: prompts must be lists of token ids, outputs
        have `token_ids` and empty `text`, and `SamplingParams.stop` strings are refused)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt and parameter set is validated before
        any request starts, so a bad one raises a ValueError and nothing runs."""
        prompt_list = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        for prompt, sp in zip(prompt_list, params, strict=True):
            self.engine._prompt_ids(prompt)  # validate everything first
            self.engine._check_stop_strings(sp)
        # n > 1: n engine requests per prompt, choice k seeded seed + k; the others wait for
        # the first's prefill and take it from the prefix cache (as the server's n does)
        groups: list[list[str]] = []
        try:
            for p, sp in zip(prompt_list, params, strict=True):
                group = [self.engine.add_request(p, replace(sp, n=1)).request_id]
                groups.append(group)
                for k in range(1, sp.n):
                    choice = replace(sp, n=1, seed=choice_seed(sp.seed, k))
                    group.append(self.engine.add_request(p, choice, after=group[0]).request_id)
        except BaseException:  # (a check only add_request makes, e.g. logit_bias ids)
            for rid in (i for g in groups for i in g):
                self.engine.abort(rid)  # nothing of this call keeps running
            raise
        outs = self._run([i for g in groups for i in g], use_tqdm)
        by_id = {o.request_id: o for o in outs}
        return [self._merge([by_id[i] for i in g]) for g in groups]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of message dicts) or several, each
        rendered by the tokenizer's chat template (or `chat_template`; the server's default
        where the tokenizer has none) as the server renders a chat completion, tokenized
        without added special tokens (the template writes them), then generated. Each
        output's `prompt` is the rendered text."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(f"{self.engine._no_tokenizer()}: chat needs a chat template")
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        if not conversations or not all(isinstance(c, list | tuple) and c for c in conversations):
            raise ValueError("messages must be a list of message dicts or a list of such lists")
        template = ChatTemplate(chat_template or tok.chat_template or DEFAULT_CHAT_TEMPLATE)
        variables = template_variables(tok.config, chat_template_kwargs)
        texts = [
            template.render(normalise_messages(list(c)), tools=tools,
                            add_generation_prompt=add_generation_prompt, **variables)  # fmt: skip
            for c in conversations
        ]
        ids = [self.engine._prompt_ids(t, add_special_tokens=False)[0] for t in texts]
        outs = self.generate(ids, sampling_params, use_tqdm)
        return [replace(o, prompt=t) for o, t in zip(outs, texts, strict=True)]

    @staticmethod
    def _merge(choices: list[RequestOutput]) -> RequestOutput:
        """One prompt's n choices as one output (vLLM's shape: outputs[k].index = k)."""
        if len(choices) == 1:
            return choices[0]
        first = choices[0]
        outputs = [replace(c.outputs[0], index=k) for k, c in enumerate(choices)]
        error = next((c.error for c in choices if c.error is not None), None)
        return replace(first, outputs=outputs, error=error)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError(
                "prompts must be a string, a list of strings or a list of token-id "
                "lists, and not empty"
            )
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        unwrapped = [LLM._unwrap(p) if isinstance(p, Mapping) else p for p in prompts]
        return [list(p) if isinstance(p, list | tuple) else p for p in unwrapped]

    @staticmethod
    def _unwrap(prompt: Mapping[str, Any]) -> Prompt:
        """vLLM's prompt dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids}
        (TokensPrompt); any other key (multimodal data, ...) is refused by name."""
        keys = set(prompt)
        if keys not in ({"prompt"}, {"prompt_token_ids"}):
            other = sorted(keys - {"prompt", "prompt_token_ids"})
            raise ValueError(
                f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids', one of them; got "
                f"{sorted(keys)}" + (f" ({', '.join(other)} not supported)" if other else "")
            )
        value = prompt.get("prompt", prompt.get("prompt_token_ids"))
        return list(value) if isinstance(value, list | tuple) else value

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"give one SamplingParams or a list of {n} (one per prompt)")
        return params
