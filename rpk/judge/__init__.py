"""The judge tier: the engines a model-as-reward runs on, apart from what a verdict is.

`rpk.reward.judge` is pure (the judge's prompt, the scorer and the router) and
`rpk.reward.verdict` says what an answer is worth; this package starts and keeps the
models that answer:
- `vllm`: a judge or reward model as a vLLM engine rpk starts and stops like a rollout
  replica, asked per verdict kind;
- `prompt`: a request as token ids through the judge's chat template, the data as text;
- `rest`: the judge's rest with the fleet (level 1, woken when next needed);
- `pool`: one engine per rollout GPU of every engine node, and the pool the scorer asks,
  which restarts an engine that dies;
- `openai` and `limits`: any OpenAI-compatible server as the judge, kept to its requests
  and tokens per minute;
- `cache`: verdicts kept by content, so a repeated response is judged once;
- `tier`: which of them serve a run's judge, and the cache in front;
- `tiny`: the tiny judge rpk builds itself, so that a judged run needs no download.
"""
