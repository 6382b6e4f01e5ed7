"""EAGLE-3 drafter on the same cache: one decoder layer drafting autoregressively over fused target features.

Architecture (EAGLE-3, Li et al. 2025, arXiv:2503.01840, sec. 3; the layer layout vLLM's ``llama_eagle3``
and speculators' ``eagle3`` checkpoints use, so that an export loads there):

    g_t     = fc([h_low ; h_mid ; h_high]_t)                    (fc: 3H -> H, no bias; no norm)
    z       = [input_layernorm(embed(x)) ; hidden_norm(hid)]     (2H: the attention's input)
    a       = o_proj(attention(q_proj z, k_proj z, v_proj z))   (Llama attention: no qk-norm, RoPE)
    r       = hid + a
    hid'    = r + mlp(post_attention_layernorm(r))               (the pre-norm output, fed back)
    logits  = lm_head(norm(hid'))

``h_low, h_mid, h_high`` are the cached features of :attr:`training.drafter.DrafterConfig.eagle3_layer_ids`
(the first, middle and last captured layer). Entry ``t`` of the drafter's context pairs the target's
features at ``t`` with the next token ``x_{t+1}``; its output predicts ``x_{t+2}``. Drafting a block after
anchor ``a`` (the token at position ``a``; the target's features known up to ``a - 1``):
step 1 is the context entry at row ``a - 1`` (token ``x_a``, hidden ``g_{a-1}``), drafting ``x_{a+1}``;
step ``k`` (2..gamma) feeds the drafter's own pre-norm output of step ``k - 1`` and the token ``x_{a+k-1}``
at position ``a + k - 2``, attending to the context entries at rows ``<= a - 1`` and the block's earlier
steps. The drafted tokens are the ones :class:`training.drafter.Drafter`'s block at the same anchor drafts,
so the block-level evaluation pairs the three drafters block by block.

Training-time test (EAGLE-3 sec. 3.3): the step ``k`` input is the drafter's own output of step
``k - 1``, as at inference, for all ``gamma`` steps; the input tokens are the data's (teacher forcing,
as the sequential head of DSpark is trained and evaluated). Step 1 runs causally over every row of the
sequence (the context entries); steps 2..gamma run only at the sampled anchors' rows
(:func:`tree_attention`). The loss is the project's (:func:`training.losses.drafter_loss`, the same
terms and position decay as DFlash and DSpark: the three drafters are trained by one framework on one
cache, as the DSpark paper's Table 1 compares them); the decay ``exp(-(k-1)/lambda)`` at lambda = 4.48
is EAGLE-3's ``0.8^(k-1)``. ``lm_head`` is the target's (its rows of a reduced draft vocabulary),
frozen, as for the other drafters.

Inference (:meth:`Eagle3Drafter.encode_context`, :meth:`Eagle3Drafter.draft_block`): the decoding loop's
interface of :class:`training.drafter.Drafter`, with the next tokens the context entries need; a KV cache of
the entered rows, one drafting step per token (equal to the training forward: ``tests/unit/training/test_eagle3.py``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from training.blocks import Blocks, DraftBatch
from training.drafter import Drafter, DrafterConfig, DraftResult, _rope, check_target_fit, draft_layer_config
from training.heads import sample_sequential
from training.losses import SupervisedSlots

__all__ = ["Eagle3Layer", "Eagle3Drafter", "Eagle3Context", "tree_attention"]


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer (module docstring): Llama attention over ``[embeds ; hidden]`` (2H).

    Parameter names are those of vLLM's ``llama_eagle3`` midlayer: ``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``.
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or H // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, self.num_heads * self.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, self.num_kv_heads * self.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, self.num_kv_heads * self.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(H, eps=eps)
        self.hidden_norm = Qwen3RMSNorm(H, eps=eps)
        self.post_attention_layernorm = Qwen3RMSNorm(H, eps=eps)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values of entries ``(embeds, hidden)`` [B, Q, H] each, RoPE by ``cos``/``sin``
        [B, Q, d]: ``(q [B, heads, Q, d], k [B, kv_heads, Q, d], v [B, kv_heads, Q, d])``."""
        B, Q, _ = hidden.shape
        z = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        attn = self.self_attn
        q = attn.q_proj(z).view(B, Q, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(z).view(B, Q, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(z).view(B, Q, -1, self.head_dim).transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def finish(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The pre-norm output [B, Q, H] from the attention output ``o`` [B, heads, Q, d] and the entries'
        input ``hidden`` [B, Q, H] (the residual: vLLM's ``norm_before_residual = False``)."""
        B, _, Q, _ = o.shape
        r = hidden + self.self_attn.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
        return r + self.mlp(self.post_attention_layernorm(r))


def tree_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, rows: torch.Tensor,
                   kx: torch.Tensor, vx: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one drafting step per block: the context entries at rows ``<= rows`` plus the block's
    own entries of the steps so far (the KV cache an autoregressive drafter holds at that step).

    Args:
        q: [B, heads, N, d] one query per block. k0, v0: [B, kv_heads, T, d] the context entries (step 1
            over every row). rows: [B, N] int64 the last context row each block sees (``anchor - 1``).
        kx, vx: [B, kv_heads, N, j, d] the block's entries of steps 2..k (the current one included).
        scale: the attention scale (``head_dim ** -0.5``).
    Returns:
        [B, heads, N, d]. Scores are [B, heads, N, T + j] (float32 softmax): at the recipe's shape
        (32 heads, 512 anchors, 4,096 positions) 268 MB per sample and step.
    """
    B, h, N, d = q.shape
    kv, T = k0.shape[1], k0.shape[2]
    qg = q.reshape(B, kv, h // kv, N, d)
    s0 = torch.einsum("bcgnd,bctd->bcgnt", qg, k0) * scale
    seen = torch.arange(T, device=q.device) <= rows.unsqueeze(-1)  # [B, N, T]
    s0 = s0.masked_fill(~seen[:, None, None], float("-inf"))
    sx = torch.einsum("bcgnd,bcnjd->bcgnj", qg, kx) * scale
    p = torch.softmax(torch.cat([s0, sx], -1).float(), -1).to(q.dtype)
    o = (torch.einsum("bcgnt,bctd->bcgnd", p[..., :T], v0)
         + torch.einsum("bcgnj,bcnjd->bcgnd", p[..., T:], vx))
    return o.reshape(B, h, N, d)


class Eagle3Drafter(Drafter):
    """EAGLE-3 drafter (module docstring) with :class:`training.drafter.Drafter`'s frozen vocabulary,
    training and evaluation interface (``make_blocks``, ``forward`` -> supervised slots, ``loss``).

    Args:
        config: a :class:`training.drafter.DrafterConfig` with ``architecture="eagle3"``.
        target_config, embed_weight, lm_head_weight, d2t: as :class:`training.drafter.Drafter`.
    Raises:
        ValueError: as :class:`training.drafter.Drafter`, or a config of another architecture.
    """

    def __init__(self, config: DrafterConfig, target_config: Qwen3Config, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, d2t: torch.Tensor | None = None):
        nn.Module.__init__(self)
        if config.architecture != "eagle3":
            raise ValueError(f"Eagle3Drafter needs architecture 'eagle3', got {config.architecture!r}")
        check_target_fit(config, target_config, embed_weight, lm_head_weight)
        H = target_config.hidden_size
        self.config = config
        self.layer_config = draft_layer_config(target_config, 1)
        ids = config.target_layer_ids
        self.register_buffer("feature_slots", torch.tensor([ids.index(i) for i in config.eagle3_layer_ids]),
                             persistent=False)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(self.layer_config)])
        self.norm = Qwen3RMSNorm(H, eps=target_config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.layer_config)
        self._init_vocab(config, embed_weight, lm_head_weight, d2t)
        self.markov_head = None
        self.confidence_head = None
        self._init_trainable(target_config.initializer_range)
        self.register_load_state_dict_pre_hook(self._check_d2t)

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``g = fc([h_low ; h_mid ; h_high])``: [B, T, n_ids*H] cached features -> [B, T, H].
        Raises ValueError for features of another width than ``len(target_layer_ids) * H``."""
        H = self.fc.out_features
        n = len(self.config.target_layer_ids)
        if features.shape[-1] != n * H:
            raise ValueError(f"features have width {features.shape[-1]}, expected {n * H} = {n} target layers x "
                             "hidden size")
        picked = features.unflatten(-1, (n, H)).index_select(-2, self.feature_slots).flatten(-2)
        return self.fc(picked.to(self.fc.weight.dtype))

    def forward(self, batch: DraftBatch, blocks: Blocks, static_shapes: bool | None = None) -> SupervisedSlots:
        """Training-time test over all blocks of a batch (module docstring): step 1 causal over every row,
        steps 2..gamma at the anchors' rows, each fed its own previous output.

        Args:
            batch: padded cache samples [B, T]. blocks: ``build_blocks`` with this config's block size
                (the DSpark layout). static_shapes: ignored (the attention is dense; accepted for the
                engines' common call).
        Returns:
            the supervised slots (:class:`training.losses.SupervisedSlots`): slot k of block n is step
            k + 1's normed output, its label ``x_{a+k+1}``. A block at anchor 0 (no context row) has none.
        Raises:
            ValueError: blocks of another layout or block size, or features of the wrong width.
        """
        cfg = self.config
        B, T = batch.input_ids.shape
        N, gamma = blocks.anchors.shape[1], cfg.block_size
        if not blocks.sample_from_anchor or blocks.labels.shape[-1] != gamma:
            raise ValueError("blocks were built with another layout or block size than this drafter's config")
        layer = self.layers[0]
        g = self._fuse(batch.features)
        H = g.shape[-1]
        nxt = F.pad(batch.input_ids[:, 1:].long(), (0, 1), value=cfg.mask_token_id)
        cos, sin = self.rotary_emb(g, torch.arange(T, device=g.device).expand(B, T))
        q, k0, v0 = layer.project(self._embed(nxt), g, cos, sin)
        o = F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=layer.scaling, enable_gqa=True)
        rows = (blocks.anchors - 1).clamp(min=0)
        hid = layer.finish(o, g).gather(1, rows.unsqueeze(-1).expand(B, N, H))
        outs, ks, vs = [hid], [], []
        for k in range(1, gamma):
            cos, sin = self.rotary_emb(hid, rows + k)
            q, kk, vv = layer.project(self._embed(blocks.prev_ids[:, :, k]), hid, cos, sin)
            ks.append(kk)
            vs.append(vv)
            o = tree_attention(q, k0, v0, rows, torch.stack(ks, 3), torch.stack(vs, 3), layer.scaling)
            hid = layer.finish(o, hid)
            outs.append(hid)
        h = self.norm(torch.stack(outs, 2))
        valid = blocks.valid & (blocks.anchors >= 1).unsqueeze(-1)
        b, n, k = valid.nonzero(as_tuple=True)
        return SupervisedSlots(
            hidden=h[b, n, k], bias_features=None, confidence_logits=None, labels=blocks.labels[b, n, k],
            slot=k, block=b * N + n, target_hidden=batch.last_hidden[blocks.target_rows[b, n, k]],
            num_blocks=B * N, block_size=gamma, prev_ids=blocks.prev_ids[b, n, k])

    def init_from_target(self, layer_state, final_norm) -> None:
        """Refused: the EAGLE-3 layer (2H attention input, no qk-norm) has no target layer to copy.
        Raises ValueError (use ``init: random`` or ``pretrained``)."""
        raise ValueError("init: target copies a target layer into a DFlash backbone; an eagle3 drafter starts "
                         "from init: random or pretrained")

    # -- inference (the decoding loop, pipeline.inference.speculate) ------------------------------
    @torch.no_grad()
    def encode_context(self, features: torch.Tensor, context: "Eagle3Context | None" = None,
                       tokens: Sequence[int] | torch.Tensor = ()) -> "Eagle3Context":
        """Append target features of the next positions to an inference context (or start one).

        A context entry needs the token after its position (module docstring), which the target has not
        produced yet for the last position: the rows wait in the context until :meth:`draft_block` gets the
        anchor, and enter the drafter's KV cache there.

        Args:
            features: [n, n_ids*H] target features of positions ``L .. L+n-1`` (L = ``context.length``).
            context: the context so far (its waiting rows are kept), or None to start at position 0.
            tokens: the next tokens known so far of the waiting rows, in order (appended to the context's):
                the prompt's ``ids[1:]`` at the start, the accepted drafts after a round.
        Returns:
            an :class:`Eagle3Context` of length L + n (``context`` itself, extended, when given).
        Raises:
            ValueError: more next tokens than waiting rows.
        """
        g = self._fuse(features.unsqueeze(0))[0]
        ctx = context if context is not None else Eagle3Context(None, None, g[:0], [])
        ctx.pending = torch.cat([ctx.pending, g])
        ctx.tokens = ctx.tokens + [int(t) for t in tokens]
        if len(ctx.tokens) >= ctx.pending.shape[0]:
            raise ValueError(f"{len(ctx.tokens)} next tokens for {ctx.pending.shape[0]} waiting rows: the last row's "
                             "next token is the anchor, given to draft_block")
        return ctx

    @torch.no_grad()
    def draft_block(self, context: "Eagle3Context", anchor_token: int | torch.Tensor, temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> DraftResult:
        """Draft ``gamma`` tokens autoregressively after ``context`` with the anchor at position ``context.length``.

        The waiting rows enter the KV cache with their next tokens (the last one's is the anchor), causally;
        the last row's output is step 1; each later step feeds its previous pre-norm output and the token it
        drew (module docstring). Each ``x_k ~ q_k = softmax(logits_k / T)`` (top-k / top-p of a
        :class:`training.spec_sampling.Sampling` applied), drawn as :func:`training.heads.sample_sequential`
        draws a slot. The committed rows stay in ``context`` (their tokens are the data's); the drafted
        steps do not.

        Args:
            context: from :meth:`encode_context`, with one more waiting row than next tokens.
            anchor_token: the target id at position ``context.length``. temperature: T >= 0 or a Sampling.
            generator: on the model's device.
        Returns:
            :class:`training.drafter.DraftResult`: tokens [gamma], q [gamma, V] (zero outside a reduced
            draft vocabulary), no confidence, ``max_q`` [gamma].
        Raises:
            ValueError: a context without a waiting row, or with its next tokens missing.
        """
        ctx, layer, gamma = context, self.layers[0], self.config.block_size
        m = ctx.pending.shape[0]
        if m == 0 or len(ctx.tokens) != m - 1:
            raise ValueError(f"the context has {m} waiting rows and {len(ctx.tokens)} next tokens; draft_block needs "
                             "one more row than tokens (encode_context the target's features of the last round first)")
        dev = self.fc.weight.device
        n0 = 0 if ctx.keys is None else ctx.keys.shape[2]
        toks = torch.tensor([*ctx.tokens, int(anchor_token)], device=dev)
        hid = ctx.pending.unsqueeze(0)
        cos, sin = self.rotary_emb(hid, torch.arange(n0, n0 + m, device=dev).unsqueeze(0))
        q, k, v = layer.project(self._embed(toks).unsqueeze(0), hid, cos, sin)
        K = k if ctx.keys is None else torch.cat([ctx.keys, k], 2)
        V = v if ctx.values is None else torch.cat([ctx.values, v], 2)
        causal = torch.arange(n0 + m, device=dev) <= torch.arange(n0, n0 + m, device=dev).unsqueeze(-1)
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=causal, scale=layer.scaling, enable_gqa=True)
        hid = layer.finish(o, hid)[:, -1:]
        ctx.keys, ctx.values, ctx.pending, ctx.tokens = K, V, ctx.pending[:0], []
        pos, x, outs, qs, logits = n0 + m - 1, None, [], [], []
        for step in range(gamma):
            if step:
                pos += 1
                cos, sin = self.rotary_emb(hid, torch.tensor([[pos]], device=dev))
                q, k, v = layer.project(self._embed(x.view(1, 1)), hid, cos, sin)
                K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
                hid = layer.finish(F.scaled_dot_product_attention(q, K, V, scale=layer.scaling, enable_gqa=True), hid)
            h = self.norm(hid)
            z = h.to(self.lm_head.weight.dtype) @ self.lm_head.weight.t()
            tok, q_k, _ = sample_sequential(z, h, toks[-1:], None, temperature, generator, self.draft_to_target)
            x = tok[0, 0]
            outs.append(x)
            qs.append(q_k[0, 0])
            logits.append(z[0, 0].float())
        q = torch.stack(qs)
        max_q = q.amax(-1) if temperature > 0 else torch.softmax(torch.stack(logits), -1).amax(-1)
        if self.draft_to_target is not None:
            q = q.new_zeros(gamma, self.embed_tokens.num_embeddings).index_copy_(1, self.draft_to_target, q)
        return DraftResult(torch.stack(outs), q, None, max_q.float(), None)


@dataclass
class Eagle3Context:
    """An EAGLE-3 drafter's inference context (:meth:`Eagle3Drafter.encode_context`).

    Attributes:
        keys, values: [1, kv_heads, n, head_dim] the drafter's KV cache of the entered rows ``0 .. n-1``
            (keys after RoPE), or None before the first draft.
        pending: [m, H] fused features ``g`` of the rows ``n .. n+m-1`` waiting for their next token.
        tokens: the next tokens known of the waiting rows (at most ``m - 1``: the last is the anchor).
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    pending: torch.Tensor
    tokens: list[int]

    @property
    def length(self) -> int:
        """Positions covered by target features (the next anchor sits at position ``length``)."""
        return (0 if self.keys is None else self.keys.shape[2]) + self.pending.shape[0]
