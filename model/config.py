"""The model's config section as a dataclass, free of torch.

trainer/config.py builds the run config from them, and train.py parses it before it imports torch, so a
config error is answered at once. optim/config.py uses its `check_choices`, `grouped` and `elements_are`
helpers.

A key with a fixed set of values says them once, as its `Literal[...]` type: `choices` reads them for the
dataclasses' own checks here and for trainer/config.py's check of files and overrides. `field_value` is the one
type check of a raw value (a TOML file's, an override's, a checkpoint's config) against a field; a list key's
elements are its section's to check (`elements_are`), before it compares them.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

VOCAB_MULTIPLE = 128  # matmul-friendly padding of the embedding/head rows

# What a key is to a resume and to a run's result, declared on its field (`grouped`); a key with no group decides
# the model, the data stream, the optimizer state or the schedule, so a resume refuses to change it:
#   "run"      where a run writes, how it is watched, checkpointed or resumed: no part of the experiment
#   "neutral"  a check of the data, a label, the eval's grouping into batches (the same windows): moves no result
#   "eval"     when evals happen: they read the model without changing it, but on the training clock
#              (train.timing = "from_first_forward") they take time from training
#   "speed"    how fast the same arithmetic runs, hence the steps a time budget buys and the time to target
#   "budget"   how long the run trains: a resume changes it only with --extend-budget
Group = Literal["run", "neutral", "eval", "speed", "budget"]


def grouped(default: Any, group: Group) -> Any:
    """A dataclass field with `default` whose key is in `group` (see Group)."""
    return field(default=default, metadata={"group": group})


def choices(hint: Any) -> tuple[Any, ...]:
    """The values a `Literal[...]` type allows; () for any other type."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def value_type(hint: Any) -> Any:
    """The type a field's value has: that of a Literal's values (str), else the hint itself."""
    allowed = choices(hint)
    return type(allowed[0]) if allowed else hint


def field_value(hint: Any, value: Any) -> Any:
    """`value` as a field of type `hint` holds it; TypeError naming the type where it is not one.

    TOML writes 15 for 15.0, so an int is a float's value; bool is a subclass of int but never a number here.
    A Literal's values are checked apart (`check_choices`, and trainer/config.py where it knows the file)."""
    kind = value_type(hint)
    origin = typing.get_origin(kind) or kind
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        return origin(value)
    if isinstance(origin, type) and isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    raise TypeError(getattr(kind, "__name__", str(kind)))


def elements_are(values: list, *types: type) -> bool:
    """Whether each element of the list `values` is of one of `types` exactly (a bool is no int): a list key's own
    check, since field_value checks the list but not what it holds."""
    return all(type(v) in types for v in values)


def check_choices(obj: Any, what: str) -> None:
    """Raise ValueError naming the first field of dataclass `obj` whose value its Literal type does not allow."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        allowed, value = choices(hint), getattr(obj, name)
        if allowed and value not in allowed:
            *most, last = map(repr, allowed)
            raise ValueError(f"{what}: {name}={value!r}; use {', '.join(most)} or {last}")


@dataclass
class GPTConfig:
    """Every model key; the defaults are the GPT-2 small baseline."""
    vocab_size: int = 50257  # the softmax's ids (the tokenizer's, or more); tables padded to a multiple of 128
    block_size: int = 1024  # longest sequence (size of the learned position table)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # model width
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * n_embd
    bias: bool = True  # biases in Linear layers and LayerNorm
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "relu2"] = "gelu"  # "gelu": tanh approximation, as GPT-2; "relu2": ReLU squared
    rotary: bool = False  # rotary position embeddings instead of a learned position table
    rope_base: float = 10000.0  # rotary base frequency
    rope_truncate: bool = False  # rotate half of each head: head_dim/4 frequencies 1 .. 1/rope_base, the rest unrotated
    qk_norm: bool = False  # RMS-normalise queries and keys per head
    attn_scale: float = 0.0  # attention logit scale; 0 = 1/sqrt(head_dim)
    attn_gate: bool = False  # each head's output times sigmoid(W x[:12]) of its input x; W starts at 0 (gates 0.5)
    norm_gain: bool = True  # learned gains in the norms
    embed_norm: bool = False  # RMS-normalise the embedding (no gain) before the first block
    smear: bool = False  # token t's embedding adds lambda * sigmoid(w . x_t[:12]) * x_{t-1}; lambda and w start at 0
    x0_mix: bool = False  # each block starts from a * x + b * x0 (x0: the embedding), a, b learned per block
    x0_mix_init: float = 1.0  # a at init (b starts at 0); record 46: 1.1
    tie_embeddings: bool = True  # head shares the token embedding matrix
    untie_at: float = 0.0  # in (0, 1): a tied head gets weights of its own at this training progress; 0 = never
    zero_init_proj: bool = False  # output projections of attention/MLP (and an untied head) start at zero
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap); 0 = off
    fp8_head: bool = False  # in training the head multiplies float8 copies of its input and weight (record 46)
    # training loss: weights of the next token and the tokens after it, each later one fading out over a stage of
    # training; [] = the next token alone
    mtp_weights: list[float] = field(default_factory=list)
    # > 0: the training loss also predicts each target's longest proper prefix token, at this weight; 0 = off
    prefix_weight: float = 0.0
    value_embeds: int = 0  # k extra token tables added to the values of the first k and last k layers
    value_embed_skip: int = 0  # the first layers take tables from this one on: the others serve the last layers alone
    value_scale: bool = False  # attention layers without a value embedding scale v by a learned scalar (from 0.5)
    bigram_hash: int = 0  # rows of a table read at a hash of (previous, current) token, added to each block; 0 = off
    bigram_dim: int = 0  # width of the bigram table, added to the first bigram_dim channels; 0 = n_embd
    bigram_signs: bool = False  # each bigram's row times a fixed +-1 pattern picked by the pair (the sign trick)
    ve_gate: bool = False  # each head's value embedding times 2 sigmoid(W [x[:6], ve[:6]]); W starts at 0 (gates 1)
    unet_skips: bool = False  # block i of the second half also adds the output of block n_layer-1-i
    skip_gate: bool = False  # each U-net skip times 2 sigmoid(w . x0[:12]); w starts at 0 (gates 1)
    # [a, b]: block b's input adds sigmoid(w) times block a's output, w learned from -1.5; [] = off
    skip_connection: list[int] = field(default_factory=list)
    backout: int = 0  # > 0: the head reads x - lambda * (the residual after the first `backout` blocks); lambda 0.5
    no_attention: list[int] = field(default_factory=list)  # layers whose block has no attention, only the MLP
    no_mlp: list[int] = field(default_factory=list)  # layers whose block has no MLP, only the attention
    xsa: list[int] = field(default_factory=list)  # layers whose heads drop tanh(a) of their output along their value
    # MUDD connections: after each listed layer, an MLP on its output weighs x0 and the mudd_sources outputs so far
    # per position; the weighted sums join the residual stream and the next layer's values; [] = off
    mudd: list[int] = field(default_factory=list)
    mudd_sources: list[int] = field(default_factory=list)  # the layers whose outputs the MUDD connections read
    attention: Literal["sdpa", "flex"] = grouped("sdpa", "speed")  # "flex": CUDA only; elsewhere SDPA, same mask
    window: int = 0  # > 0: a token attends to at most `window` tokens (itself included), at the end of training
    window_start: int = 0  # > 0: the window grows linearly with training progress from window_start to window
    # the window in each of len(list) equal stages of training, then `window` past the schedule's end (train.
    # extension_steps); [] = window_start's linear growth. Record 46: [384, 896, 1408], then 1,664
    window_stages: list[int] = field(default_factory=list)
    # > 0: S layers get half of the L layers' whole blocks of this many tokens (record 46: 128, its attention's
    # block: 1,408 -> 640); 0 = half the window
    window_block: int = 0
    window_pattern: str = ""  # a letter per layer, repeated over the layers: L = the window, S = half of it; "" = L
    # every window counts the keys before the query, its own added: window + 1 keys (FlashAttention's window_size=
    # (window, 0), record 46's); false: window keys, its own included
    window_past: bool = False
    yarn: bool = False  # rotary frequencies and attention logits rescaled (YaRN) as the window outgrows its first
    doc_causal: bool = False  # tokens never attend across a `bos_id` token (document boundaries)
    bos_id: int = 50256  # the token placed before each document (GPT-2 end-of-text)
    init_std: float = 0.02  # std of the normal init of matrices and embeddings
    embed_init_std: float = 0.0  # > 0: std of the token and value tables' normal init instead; 0 = init_std
    # the matrices' random init at their std s: N(0, s), or U(-sqrt(3) s, sqrt(3) s) (record 46's qkv and fc); the
    # tables (and a head that starts as the token table) stay normal
    init: Literal["normal", "uniform"] = "normal"

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"model config: {msg}")
        need(min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd, self.mlp_ratio) > 0,
             "vocab_size, block_size, n_layer, n_head, n_embd and mlp_ratio must be positive")
        need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        need(not self.rotary or self.head_dim % 2 == 0, f"rotary needs an even head size, got {self.head_dim}")
        check_choices(self, "model config")
        need(0 <= 2 * self.value_embeds <= self.n_layer,
             f"value_embeds={self.value_embeds} needs 0 <= 2 * value_embeds <= n_layer={self.n_layer}")
        need(0 <= self.value_embed_skip <= self.value_embeds,
             f"value_embed_skip={self.value_embed_skip} must be in [0, value_embeds={self.value_embeds}]: the tables "
             f"that serve the last layers alone, e.g. 1 (record 46, with value_embeds = 3)")
        need(self.x0_mix or self.x0_mix_init == 1.0,
             f"x0_mix_init={self.x0_mix_init} starts the x0 mix, and x0_mix = false has none: set x0_mix = true "
             f"or x0_mix_init = 1.0")
        need(not self.embed_init_std or not self.tie_embeddings,
             f"embed_init_std={self.embed_init_std} would also start the tied head at that std: set "
             f"tie_embeddings = false (record 46) or embed_init_std = 0")
        need(self.init_std >= 0, f"init_std={self.init_std} must be >= 0, the std of the init (GPT-2's: 0.02)")
        need(self.embed_init_std >= 0, f"embed_init_std={self.embed_init_std} must be >= 0 (0 = init_std)")
        skip, n = self.skip_connection, self.n_layer
        need(not skip or (len(skip) == 2 and elements_are(skip, int) and 0 <= skip[0] < skip[1] < n),
             f"skip_connection={skip} must be [] or [a, b], 0 <= a < b < n_layer={self.n_layer}: block a's output "
             f"into block b's input, e.g. [3, 6] (record 46, of 11)")
        need(not self.ve_gate or self.value_embeds > 0,
             "ve_gate = true gates the value embeddings, and value_embeds = 0 has none: set value_embeds > 0 "
             "or ve_gate = false")
        need(0 <= self.backout < self.n_layer,
             f"backout={self.backout} must count the blocks whose residual the head backs out, 0 (off) to "
             f"n_layer - 1 = {self.n_layer - 1}, e.g. 8 (the records, of 11)")
        need(not self.skip_gate or self.unet_skips,
             "skip_gate = true gates the U-net skips, and unet_skips = false has none: set unet_skips = true "
             "or skip_gate = false")
        need(min(self.window, self.window_start, self.logit_softcap, self.attn_scale) >= 0,
             "window, window_start, logit_softcap and attn_scale must be >= 0")
        need(self.prefix_weight >= 0, f"prefix_weight={self.prefix_weight} must be >= 0 (record 88: 0.25), 0 for off")
        need(0 <= self.untie_at < 1, f"untie_at={self.untie_at} must lie in [0, 1): the training progress at which "
                                     f"the head unties (record 53: 0.667), or 0 for never")
        need(self.tie_embeddings or not self.untie_at,
             f"untie_at={self.untie_at} unties a tied head, but tie_embeddings = false: set tie_embeddings = true "
             f"(the head starts as the embedding) or untie_at = 0")
        need(not self.fp8_head or self.n_embd % 16 == 0,
             f"fp8_head = true multiplies through torch._scaled_mm, whose CUDA kernels need n_embd={self.n_embd} to "
             f"be a multiple of 16: change n_embd (768, the records') or set fp8_head = false")
        # the float8 copy's fixed scale spans |w| <= 0.875; a token table, trained as one, outgrows it, and training
        # then scores a clamped head that evals do not (val loss 15.6 against a train loss of 3.0 on tiny.toml)
        need(not self.fp8_head or not self.tie_embeddings,
             "fp8_head = true casts the head's weights at a fixed scale, which a head tied to the token table "
             "outgrows as the table trains: set tie_embeddings = false (record 46's head, which untie_at needs "
             "tied) or fp8_head = false")
        weights = self.mtp_weights
        need(not weights or (elements_are(weights, int, float) and min(weights) >= 0 and weights[0] == 1),
             f"mtp_weights={weights} must be [] (the next token alone) or the next token's weight 1.0 followed by "
             f"those of the tokens after it, each >= 0, e.g. [1.0, 0.5, 0.25] (record 53)")
        need(self.rope_base > 0, f"rope_base={self.rope_base} must be > 0, the rotary base frequency (10000.0; the "
                                 f"records: 1024.0)")
        need(not self.rope_truncate or (self.rotary and self.head_dim % 4 == 0),
             f"rope_truncate needs rotary = true and a head size divisible by 4, got {self.head_dim}")
        need(self.window_start <= self.window and (self.window or not self.window_start),
             f"window_start={self.window_start} must be at most window={self.window} (and window > 0)")
        need(not self.window_pattern or (self.window > 0 and set(self.window_pattern) <= set("LS")),
             f"window_pattern={self.window_pattern!r} needs window > 0 and only the letters L and S, "
             f"e.g. 'LSSSLSSLSSSL'")
        need(self.window > 0 or not self.window_past, "window_past = true widens a window by the query's own key: "
             "it needs window > 0")
        stages = self.window_stages
        need(not stages or (not self.window_start and elements_are(stages, int) and min(stages) > 0
                            and sorted(stages) == stages and stages[-1] <= self.window),
             f"window_stages={stages} must be rising windows > 0, the last at most window={self.window}, and "
             f"replaces window_start={self.window_start} (set it to 0), e.g. [384, 896, 1408]")
        smallest = self.first_window or self.window
        need(self.window_block >= 0 and (not self.window_block or smallest >= 2 * self.window_block),
             f"window_block={self.window_block} must be >= 0 (0 = S layers get half the window) and leave the S "
             f"layers a whole block: at most half of the smallest window, {smallest}")
        need(not self.yarn or (self.rotary and 0 < self.first_window < self.window),
             f"yarn = true rescales the rotary frequencies as the window grows: it needs rotary = true and a "
             f"window that starts (window_start or window_stages[0]) above 0 and below window, got rotary = "
             f"{self.rotary}, start = {self.first_window}, window = {self.window}")
        for key, example in (("no_attention", 7), ("no_mlp", 0), ("xsa", 1), ("mudd", 9), ("mudd_sources", 7)):
            layers = getattr(self, key)
            need(elements_are(layers, int) and all(0 <= i < self.n_layer for i in layers)
                 and len(set(layers)) == len(layers),
                 f"{key}={layers} must list distinct layer indices in [0, n_layer={self.n_layer}), e.g. [{example}]")
        both = sorted(set(self.no_attention) & set(self.no_mlp))
        need(not both, f"layer(s) {both} are in both no_attention and no_mlp: a block needs one of the two; "
                       f"remove them from one list (or lower n_layer)")
        blind = sorted(set(self.xsa) & set(self.no_attention))
        need(not blind, f"xsa={self.xsa}: layer(s) {blind} have no attention (no_attention={self.no_attention}); "
                        f"remove them from xsa")
        unread = sorted(j for j in self.mudd_sources if j > max(self.mudd, default=-1))
        need(not unread, f"mudd_sources={self.mudd_sources}: layer(s) {unread} come after every layer in "
                         f"mudd={self.mudd}, so no MUDD connection reads them; remove them (or add a later layer to "
                         f"mudd), e.g. mudd = [9, 10] with mudd_sources = [7, 9] (record 81, of 11 layers)")
        need(self.bigram_hash == 0 or self.bigram_hash >= 2,
             f"bigram_hash={self.bigram_hash} must be 0 (off) or at least 2 rows (the last one is each sequence's "
             f"first token's), e.g. 251520 = 5 x 50304 (the records)")
        need(0 <= self.bigram_dim <= self.n_embd,
             f"bigram_dim={self.bigram_dim} must be in [0, n_embd={self.n_embd}] (0 = n_embd)")
        need(self.bigram_hash or not (self.bigram_dim or self.bigram_signs),
             f"bigram_dim={self.bigram_dim} and bigram_signs={self.bigram_signs} shape the bigram table, which "
             f"bigram_hash = 0 turns off: set bigram_hash > 0 or leave them at 0 and false")
        layers = self.no_attention
        k = self.value_embeds
        served = {self.layer_table(i) for i in self.attention_layers}
        unread = [j for j in range(k) if j not in served]
        need(not unread, f"value_embeds={k}: table(s) {unread} would serve only layers with no attention "
                         f"(no_attention={layers}); lower value_embeds or give one of their layers attention")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def first_window(self) -> int:
        """The L layers' window at the start of training (0 where it never changes): what YaRN stretches from."""
        return self.window_stages[0] if self.window_stages else self.window_start

    @property
    def layer_windows(self) -> str:
        """L or S for each layer: window_pattern repeated (or cut) to n_layer, so n_layer can change alone."""
        pattern = self.window_pattern or "L"
        return "".join(pattern[i % len(pattern)] for i in range(self.n_layer))

    @property
    def mlp_layers(self) -> list[int]:
        """The layers whose block has an MLP: all but those of no_mlp."""
        return [i for i in range(self.n_layer) if i not in self.no_mlp]

    @property
    def attention_layers(self) -> list[int]:
        """The layers whose block has attention: all but those of no_attention."""
        return [i for i in range(self.n_layer) if i not in self.no_attention]

    def layer_table(self, layer: int) -> int | None:
        """The value table `layer` would add (None: none): table j to layer n_layer - value_embeds + j, and from
        j = value_embed_skip on also to layer j - value_embed_skip."""
        k, skip = self.value_embeds, self.value_embed_skip
        if layer >= self.n_layer - k:
            return layer - (self.n_layer - k)
        return layer + skip if layer < k - skip else None

    @property
    def value_embed_layers(self) -> list[int]:
        """The layers that add a value embedding: those with a table (layer_table) and attention (a block without
        attention has no values)."""
        return [i for i in self.attention_layers if self.layer_table(i) is not None]

    def mudd_reads(self, layer: int) -> list[int]:
        """The layers whose outputs the MUDD connection after `layer` weighs, besides x0: mudd_sources up to it."""
        return sorted(j for j in self.mudd_sources if j <= layer)

    def mudd_feeds_values(self, layer: int) -> bool:
        """Whether the MUDD connection after `layer` also adds to values: the next layer's, if it has attention."""
        return layer + 1 in self.attention_layers

    @property
    def bigram_width(self) -> int:
        """The channels the bigram table writes, the first ones: bigram_dim, or all of them."""
        return self.bigram_dim or self.n_embd

    @property
    def tokens_ahead(self) -> int:
        """How many tokens each position's logits are trained to predict: 1, the next, without mtp_weights."""
        return max(len(self.mtp_weights), 1)

    @property
    def padded_vocab(self) -> int:
        return padded(self.vocab_size)


def padded(vocab_size: int) -> int:
    """The tables' rows for `vocab_size` ids: the next multiple of VOCAB_MULTIPLE."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def stage_of(progress: float, stages: int) -> int:
    """Which of `stages` equal stages of the run `progress` lies in: stage k from progress k / stages on, the last
    one to the end and past it. Compared as quotients, so that under a step schedule stage k starts exactly at
    the step s where s / max_steps = k / stages (both divisions round the same fraction to the same float)."""
    return sum(progress >= k / stages for k in range(1, stages))


def config_from_dict(section: dict) -> GPTConfig:
    """GPTConfig from a plain dict (a checkpoint's model section); an unknown key or a wrong type is an error
    naming the key."""
    hints = typing.get_type_hints(GPTConfig)
    unknown = sorted(set(section) - set(hints))
    if unknown:
        raise ValueError(f"model config: unknown key(s) {unknown}; valid keys are {list(hints)}. "
                         "Fix or remove them in the [model] section.")
    values = {}
    for key, value in section.items():
        try:
            values[key] = field_value(hints[key], value)
        except TypeError as e:
            raise ValueError(f"model config: {key}={value!r} must be of type {e}; "
                             "fix it in the [model] section") from None
    return GPTConfig(**values)
