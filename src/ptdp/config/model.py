"""The model's shape and options (a section of the configuration schema, :mod:`ptdp.config.fields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ptdp.config.fields import opt

AUTO_DTYPE = "auto"
ParamsDtype = Literal["auto", "float32", "float64", "bfloat16", "float16"]
"""The values of ``--params-dtype``."""
Activation = Literal["gelu", "gelu_tanh"]
"""The values of ``--activation``."""
#: The linear layers of a transformer layer: fused QKV, attention output projection, fc1 (GELU's
#: input, or SwiGLU's gate and up), fc2.
LINEARS = ("qkv", "proj", "fc1", "fc2")


def concrete_params_dtype(params_dtype: ParamsDtype, *, cuda: bool) -> ParamsDtype:
    """``params_dtype`` with :data:`AUTO_DTYPE` replaced: ``bfloat16`` when the workers train on
    CUDA GPUs (16-bit tensor-core GEMMs, float32 main parameters), ``float32`` on the CPU (where
    bfloat16 GEMMs are not faster); any other value unchanged."""
    if params_dtype != AUTO_DTYPE:
        return params_dtype
    return "bfloat16" if cuda else "float32"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the GPT model: pre-norm; by default LayerNorm, learned positions, a GELU MLP and
    biases, with the options of Llama-like models (RMSNorm, SwiGLU, rotary positions,
    grouped-query attention, no linear biases, an untied output layer)."""

    num_layers: int = opt(4, "--num-layers", "transformer layers l (all stages)", "model", plan=True)
    """Transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int = opt(128, "--hidden-size", "hidden size h", "model", plan=True)
    """Width h of the residual stream."""
    num_attention_heads: int = opt(4, "--num-attention-heads", "attention heads a", "model", plan=True)
    """Attention heads a; each has ``kv_channels`` channels (h / a by default)."""
    kv_channels: int | None = opt(
        None,
        "--kv-channels",
        "channels d of each attention head (default: hidden size / heads); QKV makes (a + 2 G) d "
        "outputs, the attention projection reads a d",
        "model",
        metavar="D",
        plan=True,
    )
    """Channels d of each attention head (query, key and value alike), decoupled from ``h / a``
    (Megatron-Core's ``kv_channels``; Qwen3: 128 with h = 2048, a = 32): the QKV projection is
    ``[(a + 2 G) d, h]`` and the attention projection ``[h, a d]``. None: ``h / a``."""
    qk_layernorm: bool = opt(
        False,
        "--qk-layernorm",
        "normalize each head's query and key (the model's --normalization over the head's channels, "
        "one weight of d shared by the heads) after the QKV projection, before rotary positions",
        "model",
        plan=True,
    )
    """Normalize each head's query and key after the QKV projection and before rotary positions
    (Qwen3's ``q_norm`` / ``k_norm``; Megatron-Core's ``qk_layernorm``) with the model's
    normalization over the head's ``d`` channels: one weight of ``d`` (and a bias with LayerNorm)
    for the queries and one for the keys, shared by every head and replicated over tp."""
    ffn_hidden_size: int | None = opt(
        None, "--ffn-hidden-size", "MLP inner width (default 4 x hidden size)", "model", plan=True
    )
    """Width of the MLP's inner layer; None means 4 * hidden_size."""
    seq_length: int = opt(128, "--seq-length", "tokens per sample s", "model", plan=True)
    """Tokens per sample s (also the number of learned positions)."""
    vocab_size: int = opt(
        4096, "--vocab-size", "vocabulary size (ptdp train: of the BPE tokenizer it trains)", "model", plan=True
    )
    """Size of the tokenizer to train (before padding)."""
    make_vocab_size_divisible_by: int = opt(
        128, "--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this x TP", "model"
    )
    """The embedding is padded to a multiple of this times tp; padded rows never affect the loss."""
    untie_embeddings_and_output_weights: bool = opt(
        False,
        "--untie-embeddings-and-output-weights",
        "give the output layer its own weight (default: tied to the input embedding)",
        "model",
        plan=True,
    )
    """Give the output layer its own weight instead of sharing the input embedding."""
    params_dtype: ParamsDtype = opt(
        "auto",
        "--params-dtype",
        "parameter/activation dtype; auto (default): bfloat16 on CUDA GPUs, float32 "
        "on CPUs; bfloat16 and float16 keep float32 main parameters and gradients, float16 with dynamic loss "
        "scaling",
        "model",
        plan=True,
        shortcuts=(
            ("--bf16", "bfloat16", "same as --params-dtype bfloat16"),
            ("--fp16", "float16", "same as --params-dtype float16"),
            ("--fp32", "float32", "same as --params-dtype float32"),
        ),
    )
    """dtype of parameters and activations: float32, float64, bfloat16 or float16 (the 16-bit
    ones with float32 main parameters and gradients; float16 with dynamic loss scaling). ``auto``
    is made concrete by :func:`ptdp.config.resolve` where the device is known
    (:func:`concrete_params_dtype`): bfloat16 on CUDA, float32 on the CPU; ``ptdp plan`` plans for
    GPUs, so bfloat16."""
    init_method_std: float = opt(0.02, "--init-method-std", "std of the normal weight init", "model")
    """Standard deviation of the normal initialisation of weights."""
    layernorm_epsilon: float = opt(1e-5, "--layernorm-epsilon", "epsilon of the norms (LayerNorm or RMSNorm)", "model")
    """Epsilon added to the variance (LayerNorm) or mean square (RMSNorm)."""
    activation: Activation = opt(
        "gelu", "--activation", "MLP activation: exact GELU or its tanh approximation (GPT-2)", "model"
    )
    """MLP activation: ``gelu`` (exact, erf) or ``gelu_tanh`` (the tanh approximation GPT-2 uses);
    unused with ``swiglu``."""
    normalization: Literal["LayerNorm", "RMSNorm"] = opt(
        "LayerNorm", "--normalization", "LayerNorm (weight, bias) or RMSNorm (weight only)", "model"
    )
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only: ``x / rms(x) * weight``)."""
    swiglu: bool = opt(
        False,
        "--swiglu",
        "gated MLP: fc1 makes gate and up halves, each --ffn-hidden-size wide; fc2(silu(gate) * up)",
        "model",
        plan=True,
    )
    """Gated MLP: fc1 makes a gate and an up projection, each ``ffn`` wide, and the MLP computes
    ``fc2(silu(gate) * up)`` (Shazeer 2020, arXiv:2002.05202)."""
    position_embedding_type: Literal["learned_absolute", "rope"] = opt(
        "learned_absolute",
        "--position-embedding-type",
        "learned position table, or rotary embeddings of q and k (rope, no table)",
        "model",
    )
    """``learned_absolute`` (a learned ``[s, h]`` table added to the token embeddings) or ``rope``
    (rotary embeddings applied to q and k in every layer, no position table; Su et al. 2021,
    arXiv:2104.09864)."""
    rotary_base: float = opt(10000.0, "--rotary-base", "base of the rotary frequencies", "model")
    """Base of the rotary frequencies: channel pair i of a head turns by ``pos * base^(-2i/d)``."""
    num_query_groups: int | None = opt(
        None,
        "--num-query-groups",
        "grouped-query attention: G key/value heads, each shared by heads / G query "
        "heads; needs heads % G == 0 and G % TP == 0 (default: multi-head attention)",
        "model",
        metavar="G",
        plan=True,
    )
    """Key/value heads G for grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245), each
    shared by a / G query heads; None: ordinary multi-head attention (a key/value heads)."""
    add_bias_linear: bool = opt(
        True,
        "--disable-bias-linear",
        "no biases in the linear layers (QKV, attention output, fc1, fc2)",
        "model",
        negate=True,
        plan=True,
    )
    """Biases in the linear layers (QKV, attention output, fc1, fc2); norms keep theirs."""
    linear_biases: tuple[str, ...] | None = None
    """The linear layers (of :data:`LINEARS`) with a bias when they are not all or none (Qwen2:
    ``("qkv",)``; a Llama config's ``attention_bias``: ``("qkv", "proj")``); ``ptdp plan`` reads it
    from a Hugging Face config, ``ptdp train`` builds biases on all four or none. None: as
    ``add_bias_linear`` says."""
    use_flash_attn: bool | None = opt(
        None,
        "--use-flash-attn",
        "attention by a fused flash kernel (no s x s scores kept or written; selective recompute "
        "then saves nothing); default: flash for the Llama presets, Hugging Face configs and on "
        "H100/H200-class GPUs, the unfused kernel of the published runs for the Megatron-paper "
        "GPT presets and other models on older GPUs",
        "model",
        plan=True,
        train=False,
    )
    """Attention by a fused kernel that keeps no ``a s x s`` score matrix for backward (FlashAttention;
    ``ptdp train``'s ``scaled_dot_product_attention``), only a log-sum-exp per head and token. A
    ``ptdp plan`` setting for runs on other stacks; None: what ``ptdp train`` does, fused unless
    ``attention_dropout`` (then the probabilities and their mask are kept, as unfused kernels do)."""
    kv_repeated: bool | None = opt(
        None,
        "--kv-repeated-before-attention",
        "plan a model that repeats each key/value head to its query heads before the attention "
        "kernel (torchtitan's Llama: repeat_kv before scaled_dot_product_attention; planner only): "
        "with grouped-query attention, the kernel keeps and context parallelism exchanges a / "
        "num_query_groups times the key/value bytes",
        "model",
        plan=True,
        train=False,
    )
    """Keys and values reach the attention kernel repeated to every query head, so what the kernel
    keeps for backward and what context parallelism exchanges (the kernel's inputs) are ``a`` heads,
    not ``kv_heads``. A ``ptdp plan`` setting for runs on other stacks; ptdp train passes the
    grouped heads (``enable_gqa``). None: not repeated."""
    hidden_dropout: float = opt(
        0.0,
        "--hidden-dropout",
        "dropout probability of the hidden states after the embeddings, the attention projection and fc2 (0: none)",
        "model",
        metavar="P",
    )
    """Dropout probability of the hidden states ``[b, s, h]`` after the embeddings, after the
    attention projection and after fc2 (before the residual adds); 0 disables. Masks come from
    :class:`ptdp.engine.tensor_parallel.random.DropoutRNG` streams: equal on the tp ranks of a replica,
    different over dp replicas."""
    attention_dropout: float = opt(
        0.0,
        "--attention-dropout",
        "dropout probability of the attention probabilities (computed without the fused kernel when > 0; 0: none)",
        "model",
        metavar="P",
    )
    """Dropout probability of the attention probabilities; 0 disables. With it, attention is
    computed explicitly (scores, causal softmax, dropout, context; the ``s x s`` probabilities are
    kept for backward) instead of by the fused ``scaled_dot_product_attention`` kernel, whose own
    dropout draws from torch's default generator and cannot follow ptdp's per-head streams. With
    context parallelism the blocks of the attention across cp ranks apply the same masks."""
    recompute_granularity: Literal["full", "selective"] | None = opt(
        None,
        "--recompute-granularity",
        "full: keep only the inputs of groups of layers and run them again in "
        "backward; selective: run only the attention core again; none (default): keep every activation",
        "recompute",
        none_choice="none",
        plan=True,
    )
    """Activation recomputation (Korthikanti et al. 2022, arXiv:2205.05198; ``ptdp.engine.model.recompute``):
    None keeps every activation; ``full`` keeps only the inputs of groups of layers and recomputes
    the groups in backward; ``selective`` recomputes only the attention core (scores, softmax,
    context). Results are identical; it trades compute for activation memory."""
    recompute_method: Literal["uniform", "block"] | None = opt(
        None,
        "--recompute-method",
        "with full: uniform = every layer, in groups of --recompute-num-layers; block = "
        "only the first --recompute-num-layers layers of each model chunk (default with full: uniform)",
        "recompute",
    )
    """With ``full``: ``uniform`` (every layer of each model chunk, in groups of
    ``recompute_num_layers``) or ``block`` (only the first ``recompute_num_layers`` layers of each
    model chunk, one by one). None with ``full``: uniform."""
    recompute_num_layers: int | None = opt(
        None,
        "--recompute-num-layers",
        "with full: layers per group (uniform, default 1) or recomputed layers per model chunk (block, required)",
        "recompute",
        metavar="N",
    )
    """With ``full``: layers per recomputed group (uniform) or recomputed layers per model chunk
    (block). None with ``full``: 1 for uniform (every layer's input kept); block needs it."""

    compile: bool = opt(
        False,
        "--compile",
        "torch.compile each transformer layer and the chunks of the output "
        "layer + loss (inductor); tensor-parallel collectives run between the compiled regions and "
        "are counted as in eager mode",
        "model",
    )
    """Compile every transformer layer's forward and each chunk of the output layer + loss with
    ``torch.compile`` (inductor; :mod:`ptdp.engine.model.compile`). The functions that communicate over tp run eagerly between
    the compiled regions. Results equal eager mode within float rounding; the first steps pay
    the compile time."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Channels d of an attention head: ``kv_channels``, else ``h / a``."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per query head without it."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def attended_kv_heads(self) -> int:
        """Key/value heads the attention kernel receives: ``kv_heads``, or every query head's with
        ``kv_repeated``."""
        return self.num_attention_heads if self.kv_repeated else self.kv_heads

    @property
    def tied(self) -> bool:
        """The output layer reads the input embedding's table."""
        return not self.untie_embeddings_and_output_weights

    @property
    def uses_rmsnorm(self) -> bool:
        """Norms are RMSNorm (a weight of h) rather than LayerNorm (weight and bias, 2h)."""
        return self.normalization == "RMSNorm"

    @property
    def linears_with_bias(self) -> tuple[str, ...]:
        """The linear layers (of :data:`LINEARS`) that have a bias."""
        if self.linear_biases is not None:
            return self.linear_biases
        return LINEARS if self.add_bias_linear else ()

    @property
    def has_position_table(self) -> bool:
        """A learned ``[s, h]`` position table on the first stage (not with rotary positions)."""
        return self.position_embedding_type == "learned_absolute"

    @property
    def llama_style(self) -> bool:
        """RMSNorm, rotary positions and no bias on every linear layer: Llama's elementwise work."""
        return self.uses_rmsnorm and not self.has_position_table and not self.add_bias_linear

    @property
    def flash_attention(self) -> bool:
        """Attention keeps no score matrix: ``use_flash_attn``, else no attention dropout."""
        return self.use_flash_attn if self.use_flash_attn is not None else not self.attention_dropout

    @property
    def has_dropout(self) -> bool:
        """Trained with dropout: each dropout keeps a 1-byte mask per value for backward."""
        return bool(self.hidden_dropout or self.attention_dropout)

    @property
    def family(self) -> str:
        """``Llama-like`` with any of the Llama options (RMSNorm, SwiGLU, rotary positions,
        grouped-query attention, no linear biases), else ``GPT``."""
        llama = (
            self.normalization == "RMSNorm"
            or self.swiglu
            or self.position_embedding_type == "rope"
            or self.num_query_groups is not None
            or not self.add_bias_linear
            or self.kv_channels is not None
            or self.qk_layernorm
        )
        return "Llama-like" if llama else "GPT"
