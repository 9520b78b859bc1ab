"""Built-in tiny model: a deterministic random Llama with a locally trained byte-level BPE tokenizer.

Nothing is downloaded. The default spec is hidden 256, 4 layers, 8 query heads, 4 KV heads (GQA),
head_dim 32, vocab 2048, context 4096, seed 0. ``build_model(TinyModelSpec(num_layers=8, ...))``
builds variants for benchmarks. Models are built once into a cache folder named after the spec's
digest, atomically (build in a temporary folder, then rename), so concurrent first uses are safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import tempfile
from typing import Iterator

from sglang_tiered.config import cache_root

BUILDER_VERSION = 1

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, EOT, "<|start_header_id|>", "<|end_header_id|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be at least 512 (256 bytes + merges + specials)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")

    def digest(self) -> str:
        blob = json.dumps({"v": BUILDER_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        return f"tiny-llama-l{self.num_layers}-ctx{self.max_position_embeddings}-{self.digest()}"




_WORDS = (
    "the cache model token prefix page tier host device memory request server tenant policy "
    "admission eviction frequency sketch hash chain layer head value key attention prompt system "
    "user assistant document context turn agent tool call result answer question data time cost "
    "bandwidth latency throughput batch queue schedule kernel gather scatter copy stream fence "
    "def return import class self for while if else elif try except with as in not and or is "
    "none true false print list dict set tuple int float str len range open read write close "
    "a an of to on at by from into over under after before again every each some many few more "
    "hello world please thanks write explain summarize translate code function test check fix bug"
).split()


def _corpus(n_lines: int = 4000, seed: int = 12345) -> Iterator[str]:
    """Deterministic text on every platform and Python version (a 64-bit LCG, no ``random``)."""
    state = seed
    punct = [" ", " ", " ", ", ", ". ", "(", ")", ": ", "\n", " = ", "_", "0", "1", "42"]

    def nxt() -> int:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return state >> 33

    for _ in range(n_lines):
        parts = []
        for _ in range(6 + nxt() % 14):
            word = _WORDS[nxt() % len(_WORDS)]
            if nxt() % 7 == 0:
                word = word.capitalize()
            parts.append(word + punct[nxt() % len(punct)])
        yield "".join(parts)


def _train_tokenizer(spec: TinyModelSpec, out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": EOS,
                "add_bos_token": False,  # the post-processor adds it
                "model_max_length": spec.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2)
    )


def _write_model(spec: TinyModelSpec, out: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file

    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    bos_id, eos_id, eot_id = added[BOS], added[EOS], added[EOT]
    assert max(max(vocab.values()), max(added.values())) < spec.vocab_size

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, eot_id],
        "torch_dtype": spec.dtype,
        "initializer_range": 0.02,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": [eos_id, eot_id]}, indent=2)
    )

    # Weights drawn directly (not through transformers' initialisers, which change between
    # releases), so the same spec gives the same bytes everywhere.
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, d, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    tensors = {
        "model.embed_tokens.weight": normal(spec.vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": normal(spec.vocab_size, h, std=0.06),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                p + "self_attn.q_proj.weight": normal(q_out, h, std=0.08),
                p + "self_attn.k_proj.weight": normal(kv_out, h, std=0.08),
                p + "self_attn.v_proj.weight": normal(kv_out, h, std=0.08),
                p + "self_attn.o_proj.weight": normal(h, q_out, std=0.04),
                p + "mlp.gate_proj.weight": normal(d, h, std=0.06),
                p + "mlp.up_proj.weight": normal(d, h, std=0.06),
                p + "mlp.down_proj.weight": normal(h, d, std=0.04),
            }
        )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def build_model(spec: TinyModelSpec | None = None, root: pathlib.Path | None = None) -> pathlib.Path:
    """Return the folder of the built model, building it on first use (no network)."""
    spec = spec or TinyModelSpec()
    root = pathlib.Path(root) if root else cache_root() / "models"
    final = root / spec.name
    if (final / "model.safetensors").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        _train_tokenizer(spec, tmp)
        _write_model(spec, tmp)
        (tmp / "sglang_tiered_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2))
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
