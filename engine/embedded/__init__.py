"""The models pdserve carries: the committed `pdserve-stories` checkpoint (trained by
`pdserve.bench.stories`, which the runtime never imports) and `pdserve-tiny` (random weights,
written on first use), and how a model name resolves to a directory (`catalog`). `catalog`
imports nothing but the standard library; `tiny` imports torch and safetensors."""
