"""Tiny random HF models built on the fly (no hub), and HF transformers' greedy reference.

Weights are drawn with a larger std than HF's init, so that logits are spread apart: greedy
argmax has clear margins and float differences between implementations never flip a token.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    GenerationConfig,
    GraniteMoeConfig,
    LlamaConfig,
    MambaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
)

TINY_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "opt",
    "qwen2_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "granitemoe",
    "gemma2",
    "mamba",
    "qwen3_5",
)
VOCAB_SIZE = 512
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = """\
The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid.
A language model reads a prompt, one token after another, and writes the next token it expects.
The scheduler decides which requests run in each step; the model runner prepares their inputs.
Blocks of sixteen tokens hold the keys and values of every layer, so a long prompt needs many
blocks. When memory runs short, the engine preempts the request that arrived last and computes
it again later. Prefill instances send their cache to decode instances over a fast transport.
One, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday, Wednesday, Thursday.
def add(a, b):
    return a + b
print(add(2, 3))  # 5
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
"""

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
)
_DECODER = dict(_COMMON, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False)


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The config make_tiny_model builds for `arch`, with `overrides` applied."""
    if arch == "llama":
        # Llama 3's rope scaling, with a short original context so that every band is used.
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return LlamaConfig(**{**_DECODER, "rope_parameters": rope, **overrides})
    if arch == "mistral":
        return MistralConfig(**{**_DECODER, "sliding_window": None, **overrides})
    if arch == "qwen2":
        return Qwen2Config(**{**_DECODER, "tie_word_embeddings": True, **overrides})
    if arch == "qwen3":
        # head_dim apart from hidden_size / num_heads, as in the real Qwen3 models.
        return Qwen3Config(**{**_DECODER, "head_dim": 32, **overrides})
    if arch == "opt":
        return OPTConfig(**{**_COMMON, "ffn_dim": 128, "word_embed_proj_dim": 64, **overrides})
    if arch == "qwen2_moe":
        moe = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        return Qwen2MoeConfig(**{**_DECODER, **moe, **overrides})
    if arch == "mixtral":
        return MixtralConfig(
            **{**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides}
        )
    if arch == "mamba":
        # Attention-free: a state of 16 per channel, a convolution over 4 inputs.
        mamba = dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            state_size=16,
            conv_kernel=4,
            time_step_rank=8,
            num_hidden_layers=2,
            pad_token_id=PAD_TOKEN_ID,
            bos_token_id=BOS_TOKEN_ID,
            eos_token_id=EOS_TOKEN_ID,
        )
        return MambaConfig(**{**mamba, **overrides})
    if arch == "qwen3_5":
        # DeltaNet, attention, DeltaNet, attention; twice the value heads of q/k heads, a quarter
        # of each attention head turned by rope, as in the real models.
        qwen = dict(
            num_hidden_layers=4,
            head_dim=32,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25
            ),
        )
        return Qwen3_5TextConfig(**{**_DECODER, **qwen, **overrides})
    if arch == "gemma2":
        # A window shorter than the tests' prompts on the first layer, full attention on the
        # second; the caps where the tiny model's scores and logits reach them.
        gemma = dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
        return Gemma2Config(**{**_DECODER, **gemma, **overrides})
    if arch == "granitemoe":
        # Every multiplier away from 1, so that each one matters.
        granite = dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=2.0,
        )
        return GraniteMoeConfig(**{**_DECODER, **granite, **overrides})
    if arch in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_config(arch, overrides)
    raise ValueError(f"Unknown tiny model architecture {arch!r}; known: {', '.join(TINY_ARCHS)}.")


def _deepseek_config(arch: str, overrides: dict[str, Any]) -> PretrainedConfig:
    """MLA with a latent narrower than the heads' keys and values, YaRN with its mscale, a dense
    first layer and a routed one: V2 without q_lora_rank and group-limited softmax routing, V3
    with q_lora_rank and sigmoid routing with the correction bias."""
    mla = dict(
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_key_value_heads=4,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=256,
            mscale=0.8,
            mscale_all_dim=0.7,
            beta_fast=32,
            beta_slow=1,
        ),
    )
    moe = dict(
        n_routed_experts=8,
        # 3 of 8 from the best 2 of 4 groups: the groups change the choice.
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    )
    common = {**_DECODER, **mla, **moe}
    if arch == "deepseek_v2":
        # HF's V2 never renormalizes its top-k weights (DeepSeek-V2's checkpoints do not ask to).
        v2 = dict(
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
        )
        return DeepseekV2Config(**{**common, **v2, **overrides})
    v3 = dict(q_lora_rank=32, routed_scaling_factor=2.5, norm_topk_prob=True)
    return DeepseekV3Config(**{**common, **v3, **overrides})


def make_tiny_model(arch: str, path: Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random `arch` model as an HF folder at `path` and return `path`.

    The folder holds config.json, model.safetensors (fp32), generation_config.json and a
    byte-level BPE tokenizer.json with a ChatML chat template; eos is <|im_end|> (id 2).
    """
    path = Path(path)
    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.save_pretrained(path)
    make_tokenizer(VOCAB_SIZE).save_pretrained(path)
    return path


def make_tiny_eagle_head(path: Path, *, seed: int = 0) -> Path:
    """An EAGLE head for make_tiny_model("llama") at `path`, in EAGLE's checkpoint layout:
    `fc` over [embedding, hidden state], one Llama layer without its input norm, and a copy of
    an embedding (pdserve uses the target's). Random weights: its guesses are rarely right."""
    path = Path(path)
    config = tiny_config("llama", num_hidden_layers=1)
    torch.manual_seed(seed)
    layer_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_weights(layer_model, seed)
    weights = {
        name.removeprefix("model."): tensor.contiguous()
        for name, tensor in layer_model.state_dict().items()
        if name.startswith(("model.layers.0.", "model.embed_tokens."))
        and "input_layernorm" not in name
    }
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = config.hidden_size
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(hidden)
    config.architectures = ["EagleLlamaForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file(weights, path / "model.safetensors")
    return path


def _reinit_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() >= 2:
                param.copy_(noise * (2.0 / math.sqrt(param.shape[-1])))
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.2 * noise)
        # DeepSeek-V3's routing bias is a buffer, saved with the weights: zero would not steer.
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=gen))


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a built-in text (deterministic, about 0.1 s)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TEXT.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=_SPECIAL_TOKENS[BOS_TOKEN_ID],
        eos_token=_SPECIAL_TOKENS[EOS_TOKEN_ID],
        pad_token=_SPECIAL_TOKENS[PAD_TOKEN_ID],
        chat_template=_CHAT_TEMPLATE,
    )


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF transformers model of an HF folder or a .gguf file, in eval mode."""
    path = Path(path)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own GGUF path (from_pretrained(gguf_file=) minus its accelerate dependency).
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """HF's logits [len(token_ids), vocab] (fp32) of one unpadded sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(
    path: Path, prompts_token_ids: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, exactly max_new_tokens tokens each.

    EOS does not stop generation (as with ignore_eos) and is never suppressed. Each step runs
    the whole sequence without a KV cache: one prompt at a time, no padding, no cache effects.
    """
    model = load_hf_model(path)
    outputs = []
    for prompt in prompts_token_ids:
        token_ids = list(prompt)
        for _ in range(max_new_tokens):
            token_ids.append(int(hf_logits(model, token_ids)[-1].argmax()))
        outputs.append(token_ids[len(prompt) :])
    return outputs


def hf_greedy_constrained(
    path: Path, prompt_token_ids: list[int], compiled_grammar: Any, max_new_tokens: int
) -> list[int]:
    """HF transformers' greedy continuation under an xgrammar grammar, masked by xgrammar's
    own kernel: the reference for structured outputs. Ends at EOS (which the grammar allows
    only at its end) or after max_new_tokens."""
    import xgrammar as xgr

    model = load_hf_model(path)
    matcher = xgr.GrammarMatcher(compiled_grammar)
    bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
    token_ids = list(prompt_token_ids)
    for _ in range(max_new_tokens):
        logits = hf_logits(model, token_ids)[-1:].clone()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits[0].argmax())
        token_ids.append(token)
        assert matcher.accept_token(token)
        if token == EOS_TOKEN_ID:
            break
    return token_ids[len(prompt_token_ids) :]
