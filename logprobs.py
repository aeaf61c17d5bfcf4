"""The model's log-probabilities of sampled tokens, and the loss's gradient in the same pass.

grpo.py states the algorithm and trainer.py applies it; this file runs the model for them, with
settings of its own (`Passes`). A micro-batch is a list of samples (prompt_ids, response_ids);
`micro_batch` lays it out on the host (one packed row, or a padded batch), `to_device` copies it
over, and `run` calls the Hugging Face model once with its output layer replaced, so that the
model returns, in place of its (B, T, vocab) logits:
- without an objective: the (K,) fp32 logprobs of the K response tokens (old-policy and
  reference passes, under no_grad);
- with one (`Objective`: a loss function of the tokens' logprobs and its per-token inputs as
  tensors): the loss itself, a scalar, whose gradient with respect to the final hidden states
  and the output layer's weight was already computed in the forward (`_FusedOutputLayer`).

The output layer runs only on the K rows that predict a response token, `chunk` rows at a time.
Each chunk's logits exist once, in fp32 for the length of one pass, which yields the sampled
tokens' logprob, the entropy of the sampling distribution softmax(logits / T) (at top_p < 1, that
over the nucleus vLLM's sampler keeps, renormalised: _outside_nucleus) and, because the loss is a
sum of per-token terms, the gradient of the loss with respect to each token's logprob
(dlogp = dL/dlogp, from the loss's own code, by autograd on that (c,) vector: the one call a
chunk makes to code outside this file), and with it the
gradients of the logits, of the hidden states and of the weight. Backward recomputes nothing: it
scales the stored gradients by its incoming gradient. The result leaves through the model's
forward, where FSDP2's hooks see it (the output weight is gathered for the forward and its
gradient reduce-scattered after the backward; a tied embedding gets both of its gradients).

No host synchronisation between the start of the forward and the end of the backward: every
boundary of a packed row (cu_seq_lens, the longest sample) comes from the host, the inputs go
over without blocking (pinned), logprobs stay on the device until `per_sample` reads all of a
mini-batch's back at once, and metrics stay tensors for the caller to read.

A sample may carry `mask` (records.Sample: 1 where the model wrote the token, 0 where an
environment did): MicroBatch.mask is then 1 on the model's tokens only, the entropy sums over
them, and grpo's per-token weights give the others no loss. Every response token is still run
through the output layer and gets a logprob (a sample's logprobs stay one vector).

A compiled version of `_chunk_grad` (torch.compile on one platform, a fused vendor op on another)
would go behind a plain function in npu_ops; none is written: plain torch runs everywhere, and
nothing here has been measured on an accelerator yet.
"""

import dataclasses
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modeling import hybrid, moe, seq_parallel, vision

# a zero-loss stand-in sample (any object with these fields is a sample here)
DUMMY = types.SimpleNamespace(prompt_ids=[0], response_ids=[0], logp=[0.0], truncated=False,
                              mask=None)

# model_types whose forward takes its attention masks prepared, as a dict per layer type
# (transformers 5.19, models/qwen2/modeling_qwen2.py and qwen3: `isinstance(causal_mask_mapping :=
# attention_mask, dict)`). Given None instead, create_causal_mask reads the position ids back to
# the host once per forward (masking_utils.find_packed_sequence_indices) for any attention whose
# mask function is registered (flash_attention_2 is; fsdp_utils' packed_sdpa is not).
# Not qwen3_5_text: transformers 5.5.4 (the Ascend stack's) takes no dict there
# (Qwen3_5TextModel._update_linear_attn_mask); given None, neither version reads anything back
# for packed_sdpa or the fused attention, which register no mask function.
PREPARED_MASKS = ("qwen2", "qwen3")


def plan_micro_batches(lengths: list[int], budget: int, packed: bool = False,
                       max_samples: int = 0, padded_budget: int = 0) -> list[list[int]]:
    """Group indices, longest first, so that each group fits `budget` tokens: packed, its total
    length (first fit), at most `max_samples` samples (0: any number), and its count x its
    longest at most `padded_budget` (0: no bound; a hybrid's Gated DeltaNet layers pad each
    sample of a row to its longest: LINEAR_PADDING); padded, its (count x max length)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if packed:
        batches, room = [], []
        for i in order:  # (a row's first sample is its longest)
            fits = next((b for b, r in enumerate(room) if lengths[i] <= r and not (
                max_samples and len(batches[b]) >= max_samples) and not (
                padded_budget and (len(batches[b]) + 1) * lengths[batches[b][0]]
                > padded_budget)), None)
            if fits is None:
                batches.append([])
                room.append(budget)
                fits = len(room) - 1
            batches[fits].append(i)
            room[fits] -= lengths[i]
        return batches
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


# A packed row of a model with Gated DeltaNet layers runs them on its samples padded to its
# longest (hybrid.conv, hybrid.chunk_rule), which the token budget does not count: one 2k-token
# sample with twenty short ones back-filled beside it pays 5-6x the row's tokens, in FLOPs and
# in the activations kept for backward. The plan bounds a row's samples x longest to this many
# times grpo.micro_batch_tokens, so those layers' memory is at most twice what the budget
# plans for the row (a row of one sample pays nothing).
LINEAR_PADDING = 2


def packed_sample_cap(config, split=None) -> int:
    """The most samples the plan may put in one packed row, the one place that says it: what the
    model's attention function takes (its max_samples: npu_ops.fusion_attention's kernel limit,
    which seq_parallel.attention passes on), less the padding sample split_row may add to a row
    under sequence parallelism (split: a seq_parallel.Split); 0: no limit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS.get(getattr(config, "_attn_implementation", None) or "")
    cap = getattr(fn, "max_samples", 0)
    return cap - 1 if cap and split is not None else cap


# grpo.shared_prefix=auto: where a rank's repeated prompts are this much of its tokens
SHARED_MIN_SAVED = 0.1


def sharing(samples: list, how: "Passes") -> bool:
    """Whether these samples' rows hold each group's prompt once: how.shared_prefix "on", or
    "auto" where it saves work, the groups' repeated prompts at least SHARED_MIN_SAVED of the
    samples' tokens. On CPU the update's time follows its tokens down to the tiny task's
    5-token prompts (bench/prefix.py); below a tenth the saving would be small beside what an
    accelerator's masked attention may cost over its causal kernel (not measured here)."""
    if how.shared_prefix != "auto" or not samples:
        return how.shared_prefix == "on" and bool(samples)
    groups = shared_groups(samples)
    repeated = sum((len(g) - 1) * len(samples[g[0]].prompt_ids) for g in groups)
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return repeated >= SHARED_MIN_SAVED * total


def row_tokens(samples: list, shared: bool) -> int:
    """The tokens a row of these samples holds (padding aside): each sample's prompt and
    response, or with `shared` each group's prompt once (shared_row)."""
    responses = sum(len(s.response_ids) for s in samples)
    if shared:
        return responses + sum(len(samples[g[0]].prompt_ids) for g in shared_groups(samples))
    return responses + sum(len(s.prompt_ids) for s in samples)


def shared_groups(samples: list) -> list[list[int]]:
    """The samples' indices by prompt (the same prompt_ids and the same images), in first-seen
    order: a GRPO group's samples, or those of it in this list."""
    found = {}
    for i, s in enumerate(samples):
        alike = found.setdefault(tuple(s.prompt_ids), [])
        group = next((g for g in alike if same_images(samples[g[0]], s)), None)
        if group is None:
            alike.append(group := [])
        group.append(i)
    return sorted((g for alike in found.values() for g in alike), key=lambda g: g[0])


def same_images(a, b) -> bool:
    """Whether two samples' prompts hold the same images (records.Sample.vision): none, the
    same record (a group's samples share theirs), or equal patches."""
    u, v = getattr(a, "vision", None), getattr(b, "vision", None)
    return u is v or (u is not None and v is not None and torch.equal(u.grid_thw, v.grid_thw)
                      and torch.equal(u.pixel_values, v.pixel_values))


def plan_shared(samples: list, budget: int, max_segments: int = 0) -> list[list[int]]:
    """plan_micro_batches for rows whose groups hold their prompt once (shared_row): a unit is
    a prompt and as many of its group's responses (longest first) as fit `budget` tokens with
    it, a segment each and one for the prompt (at most `max_segments` a row, 0: any number); the
    units, longest first, into rows by first fit. Returns each row's sample indices, a unit's
    consecutive."""
    units = []
    for group in shared_groups(samples):
        prompt = len(samples[group[0]].prompt_ids)
        unit, room = [], budget - prompt
        for i in sorted(group, key=lambda i: -len(samples[i].response_ids)):
            n = len(samples[i].response_ids)
            if unit and (n > room or (max_segments and len(unit) + 2 > max_segments)):
                units.append(unit)
                unit, room = [], budget - prompt
            unit.append(i)
            room -= n
        units.append(unit)
    cost = [len(samples[u[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in u)
            for u in units]
    rows, room, segments = [], [], []
    for u in sorted(range(len(units)), key=lambda u: -cost[u]):
        fits = next((r for r in range(len(rows)) if cost[u] <= room[r] and not (
            max_segments and segments[r] + len(units[u]) + 1 > max_segments)), None)
        if fits is None:
            rows.append([])
            room.append(budget)
            segments.append(0)
            fits = len(rows) - 1
        rows[fits] += units[u]
        room[fits] -= cost[u]
        segments[fits] += len(units[u]) + 1
    return rows


def micro_batch_plan(samples: list, budget: int, packed: bool, config=None, split=None,
                     shared: bool = False) -> list[list[int]]:
    """plan_micro_batches (shared: plan_shared), topped up with empty entries so that every rank
    runs as many forwards as the busiest (FSDP all-gathers per forward); an empty entry is a
    zero-loss DUMMY forward. Packed rows hold at most as many samples (segments) as the model's
    attention takes, padding included (packed_sample_cap; split: the seq_parallel.Split the
    rows are split over, or None), and for a model with Gated DeltaNet layers, samples x
    longest within LINEAR_PADDING x budget."""
    cap = packed_sample_cap(config, split) if packed else 0
    padded = LINEAR_PADDING * budget if config is not None and hybrid.has_linear_attention(
        config) else 0
    plan = (plan_shared(samples, budget, cap) if shared else plan_micro_batches(
        [len(s.prompt_ids) + len(s.response_ids) for s in samples], budget, packed, cap,
        padded))
    n = torch.tensor(len(plan))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return plan + [[]] * (int(n) - len(plan))


@dataclass
class MicroBatch:
    """One forward's samples, laid out for the model. K = response tokens, in sample order (each
    sample's response, first token first): the layout of every per-token vector here and in
    grpo. (n, L) = (samples, longest response): the padded layout of grpo's sequence-wise math."""
    inputs: dict  # the model's keyword arguments
    rows: torch.Tensor  # (K,) long: the row of the flattened (B*T, H) hidden states predicting it
    targets: torch.Tensor  # (K,) long: the response tokens
    seq: torch.Tensor  # (K,) long: each token's sample
    col: torch.Tensor  # (K,) long: its index within its response
    mask: torch.Tensor  # (n, L) float: 1 on the response tokens the model wrote
    lengths: list  # (n,) response lengths, on the host
    real: torch.Tensor  # (B*T,) bool: the flattened input's positions that hold a sample's token
    routing: torch.Tensor | None = None  # (layers, B*T, k) the engine's experts (moe.py), or None
    # sequence parallel (split_row): this rank's tokens, a range of K, and every rank's bounds
    local: slice | None = None
    bounds: list | None = None
    split: object = None  # seq_parallel.Split: the group whose ranks share the row

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """(n, L) -> (K,)"""
        return x[self.seq, self.col]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """(K,) -> (n, L), zeros elsewhere"""
        return x.new_zeros(self.mask.shape).index_put_((self.seq, self.col), x)

    def mine(self, x):
        """(K, ...) -> this rank's tokens of them (all of them without sequence parallel)."""
        return x if self.local is None else x[self.local]


def micro_batch(samples: list, pad_id: int, packed: bool, config=None, split=None,
                shared: bool = False) -> MicroBatch:
    """Lay out `samples` on the host. packed: one row of the samples end to end, position ids
    restarting at 0 for each, and the row's boundaries as transformers' flash attention takes
    them (cu_seq_lens_q/k, max_length_q/k), which fsdp_utils.packed_sdpa reads too, plus the
    samples' ends as host ints (packed_ends, for npu_ops.fusion_attention); else a padded
    batch, right-padded, with no attention mask: causal attention never lets a real token see the
    padding after it, and padded positions carry no loss. Either way no attention mask is built
    (see PREPARED_MASKS; config: the model's). The mask is 1 on the tokens the model wrote:
    all of a response, or where a sample's own `mask` says so. split (seq_parallel.Split, packed
    only): this rank's share of the row (split_row). A vision-language model (config) also
    gets its multimodal positions and the samples' images (vision.row_inputs, batch_inputs).
    shared (packed, no split): each group's prompt once (shared_row)."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    lens = torch.tensor([len(x) for x in seqs])
    prompt = torch.tensor([len(s.prompt_ids) for s in samples])
    lengths = [len(s.response_ids) for s in samples]
    resp = torch.tensor(lengths)
    seq = torch.repeat_interleave(torch.arange(len(samples)), resp)  # (K,)
    col = torch.arange(int(resp.sum())) - torch.repeat_interleave(resp.cumsum(0) - resp, resp)
    if shared:
        inputs, rows = shared_row(samples, config)
    elif packed:
        starts = lens.cumsum(0) - lens  # (n,) each sample's first row
        ids = torch.tensor([t for x in seqs for t in x])[None]  # (1, R)
        positions = torch.arange(ids.shape[1]) - torch.repeat_interleave(starts, lens)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        longest = int(lens.max())
        inputs = {"input_ids": ids, "position_ids": positions[None], "cu_seq_lens_q": cu,
                  "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
                  "packed_ends": tuple(cu[1:].tolist())}  # host ints: npu_ops.fusion_attention
    else:
        T = int(lens.max())
        starts = torch.arange(len(samples)) * T
        ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, :len(x)] = torch.tensor(x)
        inputs = {"input_ids": ids}
    if vision.is_vision_language(config) and not shared:  # multimodal positions, the images
        inputs.update(vision.row_inputs(samples, positions) if packed
                      else vision.batch_inputs(samples, ids.shape[1]))
    if not shared:  # position p - 1 + j of sample i predicts its response token j (p: its
        rows = (starts + prompt - 1)[seq] + col  # prompt's length)
    positions = inputs["input_ids"].numel()
    real = (torch.ones(positions, dtype=torch.bool) if packed or shared  # a row: no padding
            else (torch.arange(ids.shape[1])[None] < lens[:, None]).reshape(-1))
    if getattr(config, "model_type", None) in PREPARED_MASKS:
        inputs["attention_mask"] = {t: None for t in set(config.layer_types)}
    written = torch.tensor([float(m) for s in samples
                            for m in (s.mask or [1] * len(s.response_ids))])
    mb = MicroBatch(inputs=inputs, rows=rows,
                    targets=torch.tensor([t for s in samples for t in s.response_ids]),
                    seq=seq, col=col, lengths=lengths,
                    mask=torch.zeros(len(samples), max(lengths)).index_put_((seq, col), written),
                    real=real, routing=None if shared else moe.given_routing(samples, starts,
                                                                            positions))
    return mb if split is None else split_row(mb, split, pad_id)


def shared_row(samples: list, config=None) -> tuple[dict, torch.Tensor]:
    """A packed row in which each group of samples sharing a prompt (shared_groups) holds the
    prompt once, then the group's responses, each response's positions continuing from the
    prompt's length: the model's input ids and position ids, its attention's `shared_segments`
    (each prompt a segment, each response one whose keys are its prompt's and its own:
    segment_layout), and for a vision-language model (config) each position's multimodal ones
    and each group's images once (vision.row_inputs, given where each of the row's positions
    sits in the samples laid end to end); and each response token's row (K,) in sample order.
    The first token of a response is predicted at its prompt's last row, which every response
    of the group shares; each later one at the token before it."""
    # where each sample starts in the repeated layout
    begins = [0] + torch.tensor([len(s.prompt_ids) + len(s.response_ids)
                                 for s in samples]).cumsum(0).tolist()
    ids, pos, source, segments, first, start = [], [], [], [], {}, {}
    groups = shared_groups(samples)
    for group in groups:
        prompt, base = samples[group[0]].prompt_ids, len(ids)
        ids += prompt
        pos += range(len(prompt))
        source += range(begins[group[0]], begins[group[0]] + len(prompt))
        segments.append((base, len(prompt), base, 0))
        for i in group:
            response = samples[i].response_ids
            start[i], first[i] = len(ids), base + len(prompt) - 1
            segments.append((len(ids), len(response), base, len(prompt)))
            ids += response
            pos += range(len(prompt), len(prompt) + len(response))
            source += range(begins[i + 1] - len(response), begins[i + 1])
    rows = torch.tensor([first[i] if j == 0 else start[i] + j - 1
                         for i, s in enumerate(samples) for j in range(len(s.response_ids))])
    inputs = {"input_ids": torch.tensor(ids)[None], "position_ids": torch.tensor(pos)[None],
              "shared_segments": segment_layout(segments)}
    if vision.is_vision_language(config):
        inputs.update(vision.row_inputs(samples, inputs["position_ids"][0], torch.tensor(source),
                                        [samples[g[0]] for g in groups]))
    return inputs, rows


def segment_layout(segments: list) -> dict:
    """The index tensors an attention takes a shared row with (fsdp_utils.shared_sdpa), from
    its segments (start, length, prefix start, prefix length): "prompt" (S_p, L_p), each
    prompt's positions, padded with its first; "query" (S_r, L_r), each response's; "kv" (S_r,
    L_k), its prefix's positions then its own; "keep" (S_r, 1, L_r, L_k) bool, which keys each
    response position sees: its prefix, and its own up to itself (bottom-right causal); and
    "prompt_real", "query_real", which positions of those are the row's (not padding)."""
    def padded(ranges):  # [[positions...]] -> (S, L) long, its first repeated, and (S, L) bool
        width = max(len(r) for r in ranges)
        index = torch.tensor([r + [r[0]] * (width - len(r)) for r in ranges])
        return index, torch.arange(width)[None] < torch.tensor([len(r) for r in ranges])[:, None]

    prompts = [list(range(s, s + n)) for s, n, _, p in segments if p == 0]
    responses = [(list(range(s, s + n)), list(range(b, b + p))) for s, n, b, p in segments if p]
    out = {}
    out["prompt"], out["prompt_real"] = padded(prompts)
    if responses:
        out["query"], out["query_real"] = padded([own for own, _ in responses])
        kv, kv_real = padded([prefix + own for own, prefix in responses])
        prefix = torch.tensor([len(p) for _, p in responses])[:, None, None]  # (S_r, 1, 1)
        q = torch.arange(out["query"].shape[1])[None, :, None]  # (1, L_r, 1)
        k = torch.arange(kv.shape[1])[None, None, :]  # (1, 1, L_k)
        out["kv"], out["keep"] = kv, ((k <= prefix + q) & kv_real[:, None, :])[:, None]
    return out


def split_row(mb: MicroBatch, split, pad_id: int) -> MicroBatch:
    """A packed micro-batch's share for this rank of its sequence-parallel group (split: its
    seq_parallel.Split, `size` ranks, this one's `rank` there): the
    row padded to a multiple of size (the padding one more sample, seen by no other), this
    rank's n = R / size consecutive positions of it as the model's input, the whole row's
    boundaries under `row` (for seq_parallel.attention, with the row's position ids), and the
    response tokens those positions predict: a range of K (`local`; the targets were taken
    from the whole row first, so none is lost at a boundary). seq, col, mask and lengths stay
    the whole micro-batch's."""
    inputs, rank, size = mb.inputs, split.rank, split.size
    ids, positions, cu = inputs["input_ids"], inputs["position_ids"], inputs["cu_seq_lens_q"]
    pad = -ids.shape[1] % size
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], 1)
        positions = torch.cat([positions, torch.arange(pad)[None]], 1)
        cu = torch.cat([cu, cu.new_tensor([ids.shape[1]])])
    n, longest = ids.shape[1] // size, max(inputs["max_length_q"], pad)
    row = {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
           "max_length_q": longest, "max_length_k": longest, "packed_ends": tuple(cu[1:].tolist()),
           "group": split.group}  # for a hybrid's Gated DeltaNet layers (hybrid.conv)
    mine = slice(rank * n, (rank + 1) * n)
    local = {"input_ids": ids[:, mine], "position_ids": positions[:, mine], "row": row}
    if "attention_mask" in inputs:
        local["attention_mask"] = inputs["attention_mask"]
    bounds = torch.searchsorted(mb.rows, torch.arange(size + 1) * n).tolist()
    k = slice(bounds[rank], bounds[rank + 1])
    real = torch.cat([mb.real, torch.zeros(pad, dtype=torch.bool)])[mine]
    routing = (None if mb.routing is None else torch.cat(
        [mb.routing, mb.routing.new_full((mb.routing.shape[0], pad, mb.routing.shape[2]), -1)],
        1)[:, mine])
    return dataclasses.replace(mb, inputs=local, rows=mb.rows[k] - rank * n,
                               targets=mb.targets[k], real=real, routing=routing, local=k,
                               bounds=bounds, split=split)


def to_device(x, device):
    """Tensors (also inside dicts and dataclasses) onto `device`; from pinned host memory and
    without blocking the host where the device is not the host itself."""
    if isinstance(x, torch.Tensor):
        pin = torch.device(device).type != "cpu"
        return (x.pin_memory() if pin else x).to(device, non_blocking=pin)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if dataclasses.is_dataclass(x):  # MicroBatch, grpo.Tokens: their tensors (a list stays)
        return type(x)(**{k: to_device(v, device) for k, v in vars(x).items()})
    return x


# ----------------------------------------------------------------------------------------------
# the output layer, a chunk of K rows at a time


@dataclass(frozen=True)
class Passes:
    """How the model's passes run: the sampling distribution whose logprobs they take,
    softmax(logits / temperature) over the nucleus that vLLM's sampler keeps at top_p < 1 (the
    engine's: rollout.temperature, rollout.top_p), the output layer's rows a chunk holds, the
    micro-batches (`micro_batch_plan`: tokens per forward, packed or padded) and where."""
    temperature: float = 1.0
    top_p: float = 1.0
    chunk: int = 1024  # output-layer rows at a time: at most (chunk x vocab) fp32 logits
    micro_batch_tokens: int = 8192  # tokens per forward on one rank (padding counts unpacked)
    pack: bool = True  # a micro-batch is one row of samples end to end, no padding
    pad_id: int = 0  # the padding token (padded micro-batches)
    device: object = "cpu"  # where the model computes
    # packed rows hold each group's prompt once (shared_row): "on", "auto" (where it saves
    #   work: `sharing`) or "off"; on and auto only where the model takes it (grpo.shared_prefix)
    shared_prefix: str = "off"


@dataclass(frozen=True)
class Objective:
    """What `run` minimises over a micro-batch's K response tokens: a loss function and data.
    loss(logp (c,), terms[k]) -> (the loss of those c tokens, a count): a sum of per-token terms
    (grpo.grpo_loss), which the pass differentiates with respect to logp chunk by chunk; terms:
    its per-token inputs (anything sliced as terms[k], K rows); sequences(logp (K,)) -> terms:
    where the loss needs every token's logp of this forward before any gradient (a sequence's
    ratio), the terms completed from them, once a micro-batch, after one more pass over the
    vocabulary; entropy_weights (K,) b: the loss gains -sum b H, H each token's sampling
    distribution's entropy; top_ids, top_logp (K, k) and top_coef (K,): the forward KL from a
    target known by its top k tokens (top_k_forward_kl), weighed by top_coef."""
    loss: object
    terms: object
    sequences: object = None
    entropy_weights: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None
    top_coef: torch.Tensor | None = None

    def __getitem__(self, k: slice) -> "Objective":
        """The tokens k's (a sequence-parallel rank's: MicroBatch.mine)."""
        tensors = ("entropy_weights", "top_ids", "top_logp", "top_coef")
        return dataclasses.replace(self, terms=self.terms[k], **{
            name: getattr(self, name)[k] for name in tensors if getattr(self, name) is not None})


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pass's sums: fp32, or the compute dtype if wider (fp64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


def _logits(h, weight, bias, temperature: float) -> torch.Tensor:
    """(c, H) final hidden states -> (c, V) fp32 logits / temperature (the GEMM in the compute
    dtype, then one fp32 copy that the caller owns)."""
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(_wide(z.dtype))
    return z.div_(temperature) if temperature != 1.0 else z


# rows of a chunk whose nucleus is found at once: the sort's (r, V) values and int64 indices and
# the softmax's copy, 17 bytes a vocabulary entry, stay below 200 MB at a 152k vocabulary
NUCLEUS_ROWS = 64


def _outside_nucleus(z, top_p: float, targets) -> torch.Tensor:
    """(c, V) logits / T -> (c, V) bool: True on the tokens vLLM's sampler drops at top_p, the
    rows' targets excepted. Kept, in z's dtype (fp32 as vLLM's): the largest logits up to and
    including the one whose cumulative probability, counted from the largest, first reaches
    top_p, and always the largest one; ties ordered as torch.sort orders them. A target outside
    (the trainer's logits a rounding away from the engine's, which sampled it) joins its row's
    set: its logp is then z_t - logsumexp over the set and it, finite, with that gradient."""
    outside = torch.empty(z.shape, dtype=torch.bool, device=z.device)  # (c, V)
    bound = 1 - torch.tensor(top_p, dtype=torch.float32)  # fp32, as vLLM's sampling metadata
    for s in range(0, z.shape[0], NUCLEUS_ROWS):  # the sort's buffers for a few rows at a time
        # vLLM 0.32 v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p_pytorch, op for op
        zs, idx = z[s:s + NUCLEUS_ROWS].sort(dim=-1)  # ascending, (r, V) each
        drop = zs.softmax(dim=-1).cumsum_(dim=-1) <= bound
        drop[:, -1] = False  # at least one
        outside[s:s + NUCLEUS_ROWS].scatter_(1, idx, drop)
    return outside.scatter_(1, targets[:, None], False)


def _renormalise(logp_all, p, outside) -> None:
    """In place: (c, V) log softmax and softmax of the full vocabulary -> those of the nucleus
    (p 0 outside it; logp_all finite there, to be read only where p > 0)."""
    mass = p.masked_fill_(outside, 0).sum(1, keepdim=True)  # (c, 1) the nucleus's share
    p.div_(mass)
    logp_all.sub_(mass.log_())


def _entropies(logp_all, p) -> torch.Tensor:
    """(c, V) log softmax and softmax -> (c,) each row's entropy -sum p log p, as c dot
    products (no (c, V) temporary: the pass without gradient keeps logp_all); p 0 where
    logp_all is not to be read (outside a nucleus)."""
    return -(p[:, None, :] @ logp_all[:, :, None])[:, 0, 0]


@torch.no_grad()
def _logp_pass(h, weight, bias, targets, how: Passes, top_k: int = 0,
               entropy: bool = False) -> dict:
    """(K, H), (K,) targets -> {"logp": (K,) fp32 log softmax(logits / T) of the targets} (T:
    how.temperature), over the nucleus at how.top_p < 1 (_outside_nucleus, renormalised as
    _chunk_grad does), how.chunk rows at a time; with top_k > 0, "top_logp" and "top_ids"
    (K, k), the k largest logprobs of each row and their token ids; with entropy, "entropy"
    (K,), each row's sampling distribution's (_chunk_grad's)."""
    wide, K = _wide(h.dtype), h.shape[0]
    k = min(top_k, weight.shape[0])
    out = {"logp": torch.empty(K, dtype=wide, device=h.device)}
    if k:
        out.update(top_logp=torch.empty(K, k, dtype=wide, device=h.device),
                   top_ids=torch.empty(K, k, dtype=torch.long, device=h.device))
    if entropy:
        out["entropy"] = torch.empty(K, dtype=wide, device=h.device)
    top_p = how.top_p
    for s in range(0, K, how.chunk):
        rows = slice(s, s + how.chunk)
        z = _logits(h[rows], weight, bias, how.temperature)  # (c, V)
        logp = z.log_softmax(-1)  # (c, V)
        if top_p < 1:
            outside = _outside_nucleus(z, top_p, targets[rows])
            _renormalise(logp, torch.exp(logp, out=z), outside)
        if entropy:
            out["entropy"][rows] = _entropies(logp, z if top_p < 1 else torch.exp(logp, out=z))
        if top_p < 1:
            logp.masked_fill_(outside, -float("inf"))
        out["logp"][rows] = logp.gather(1, targets[rows, None])[:, 0]
        if k:
            torch.topk(logp, k, dim=1, out=(out["top_logp"][rows], out["top_ids"][rows]))
    return out


def top_k_forward_kl(logp_all, p, ids, target, coef):
    """The forward KL from a target distribution known by its top k tokens to this pass's, per
    row of a chunk: sum over the k tokens of t (log t - log p), plus the target's remaining mass
    against the pass's mass on every other token (one bucket), so it is a true KL (0 only where
    the two agree on the k tokens and on the rest; with k = V, the full one).

    logp_all, p (c, V): the pass's log softmax and softmax; ids, target (c, k): the k token ids
    and the target's logprobs of them; coef (c,): each row's weight. Returns the chunk's sum of
    coef * KL (0-dim) and its gradient with respect to the logits the softmax took (c, V):
    coef * (p - t on the k ids - t_rest * p / p_rest off them). One more (c, V) buffer."""
    t = target.exp()  # (c, k)
    rest_t = (1 - t.sum(1)).clamp(min=0)  # (c,) the target's mass off its k tokens
    g = p.clone().scatter_(1, ids, 0)  # (c, V) the pass's probabilities off the k tokens
    rest = g.sum(1).clamp(min=torch.finfo(g.dtype).tiny)  # (c,)
    kl = (t * (target - logp_all.gather(1, ids))).sum(1) \
        + torch.xlogy(rest_t, rest_t) - torch.xlogy(rest_t, rest)
    g.mul_((-rest_t / rest)[:, None]).add_(p).scatter_add_(1, ids, -t)
    return kl @ coef.to(kl.dtype), g.mul_(coef.to(g.dtype)[:, None])


def _chunk_grad(h, weight, bias, targets, written, how: Passes, objective: Objective,
                rows: slice):
    """One pass over a chunk's logits. Returns the (c,) logp of the targets, the entropy sum of
    the sampling distribution over the chunk's rows where `written` (c,) is 1, the chunk's loss
    and count from objective.loss (plus its teacher term's), and dL/dlogits (c, V) in the
    compute dtype. The sampling distribution (how): softmax(logits / T), and at top_p < 1 that over
    the nucleus vLLM's sampler keeps (_outside_nucleus), renormalised, 0 elsewhere; the logp
    and the entropy are of it. The objective's top-k term is of the whole distribution (c, V),
    of the full softmax whatever top_p (a teacher's token outside the nucleus would make a KL
    to it infinite): its loss and its gradient with respect to logits / T (top_k_forward_kl).
    Its entropy weights b: the loss gains -sum b H over the rows, H the sampling distribution's
    entropy, its gradient with the logprobs' (no more (c, V) buffers)."""
    temperature, o = how.temperature, objective
    z = _logits(h, weight, bias, temperature)  # (c, V), ours to overwrite
    outside = (_outside_nucleus(z, how.top_p, targets) if how.top_p < 1
               else None)  # (c, V) bool
    logp_all = z.log_softmax(-1)  # (c, V)
    p = torch.exp(logp_all, out=z)  # (c, V) the full softmax, in z's memory
    extra, g = ((0.0, None) if o.top_ids is None else top_k_forward_kl(
        logp_all, p, o.top_ids[rows], o.top_logp[rows], o.top_coef[rows]))
    if outside is not None:  # the nucleus: p_S = p / p(S) on S, 0 off it
        _renormalise(logp_all, p, outside)
    logp = logp_all.gather(1, targets[:, None])[:, 0]  # (c,)
    plogp = logp_all.mul_(p)  # p log p, in logp_all (0 off the nucleus)
    rows_h = -plogp.sum(1)  # (c,) each row's entropy
    entropy = rows_h @ written.to(z.dtype)
    bonus = None if o.entropy_weights is None else o.entropy_weights[rows]  # -sum bonus x H
    if bonus is not None:  # dH/dz = -p (log p + H): d(-b H)/dz = b (p log p + p H), in place
        bonus = bonus.to(z.dtype)
        extra = extra - rows_h @ bonus
        bonus = plogp.addcmul_(p, rows_h[:, None]).mul_(bonus[:, None])
    del logp_all, plogp
    with torch.enable_grad():  # the loss's own code (grpo.grpo_loss), on a (c,) leaf
        leaf = logp.detach().requires_grad_()
        value, clipped = o.loss(leaf, o.terms[rows])
        (dlogp,) = torch.autograd.grad(value, leaf, materialize_grads=True)  # dL/dlogp
    # logp = z[t] - logsumexp_S(z) with z = logits / T and S the kept set (the whole vocabulary
    # at top_p 1; a selection, constant between its jumps: no gradient through it):
    # dlogp/dlogits = (onehot(t) - p_S) / T, 0 off S
    dlogp = dlogp / temperature  # (c,)
    dz = p.mul_(-dlogp[:, None])  # (c, V), in p's memory
    dz.scatter_add_(1, targets[:, None], dlogp[:, None])
    if g is not None:
        dz.add_(g, alpha=1 / temperature)
    if bonus is not None:
        dz.add_(bonus, alpha=1 / temperature)
    return logp, entropy, value.detach() + extra, clipped, dz.to(h.dtype)


class _FusedOutputLayer(torch.autograd.Function):
    """forward(hidden (B, T, H), weight (V, H), bias (V,) or None, ...) -> the micro-batch's loss
    (0-dim fp32), with the gradients of hidden, weight and bias computed on the way, chunk by
    chunk; backward scales them by its incoming gradient. The weight's gradient sums over chunks
    in fp32 and is cast to the weight's dtype once; a frozen weight or bias gets none."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, mb: MicroBatch, how: Passes, objective: Objective,
                out: dict):
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
        h = flat.index_select(0, mb.rows)  # (K, H): only rows that predict a response token
        written = mb.mine(mb.flat(mb.mask))  # (K,): this rank's tokens
        if objective.sequences is not None:  # every token's logp first, without gradient
            logp = _logp_pass(h, weight, bias, mb.targets, how)["logp"]
            objective = dataclasses.replace(objective, terms=objective.sequences(
                logp if mb.local is None  # sequence parallel: every rank's
                else seq_parallel.gather_tokens(logp, mb.bounds, mb.split)))
        f32 = {"dtype": _wide(weight.dtype), "device": weight.device}
        grad_hidden = torch.zeros_like(flat)
        # a frozen output layer (adapters) gets no gradient: a third of its FLOPs saved
        grad_weight = torch.zeros(weight.shape, **f32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, **f32) if ctx.needs_input_grad[2] else None
        logps, total = [], {k: torch.zeros((), **f32) for k in ("loss", "entropy", "clipped")}
        for s in range(0, h.shape[0], how.chunk):
            k = slice(s, s + how.chunk)
            logp, entropy, value, clipped, dz = _chunk_grad(h[k], weight, bias, mb.targets[k],
                                                            written[k], how, objective, k)
            grad_hidden.index_add_(0, mb.rows[k], dz @ weight)  # (c, H); a shared prompt's
            #   last row predicts each of its responses' first token: theirs add up
            if grad_weight is not None and dz.dtype == grad_weight.dtype:
                grad_weight.addmm_(dz.t(), h[k])  # (V, H)
            elif grad_weight is not None:  # a GEMM in the compute dtype, summed in fp32
                grad_weight.add_(dz.t() @ h[k])
            if grad_bias is not None:
                grad_bias.add_(dz.sum(0))
            logps.append(logp)
            for name, v in (("loss", value), ("entropy", entropy), ("clipped", clipped)):
                total[name] += v
        out.update(logp=torch.cat(logps) if logps else h.new_zeros(0, dtype=f32["dtype"]),
                   entropy=total["entropy"], clipped=total["clipped"])
        ctx.grads = (grad_hidden.view(hidden.shape),
                     None if grad_weight is None else grad_weight.to(weight.dtype),
                     None if grad_bias is None else grad_bias.to(bias.dtype))
        return total["loss"]

    @staticmethod
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        return (*(None if x is None else x.mul_(grad_loss) for x in grads),) + (None,) * 4


def run(model, mb: MicroBatch, how: Passes, objective: Objective | None = None,
        top_k: int = 0, entropy: bool = False) -> dict:
    """One forward of the micro-batch `mb` (on the device) through the model. Returns "logp", the
    (K,) fp32 logprobs of the response tokens under softmax(logits / how.temperature), over the
    nucleus that vLLM's sampler keeps at how.top_p < 1, renormalised (_outside_nucleus)
    (detached); without an objective and with top_k > 0, also "top_logp" and "top_ids" (K, k),
    each row's k most likely tokens, and with entropy, "entropy" (K,), each token's
    distribution's. With an objective (this rank's tokens'): also "loss" (0-dim; its backward()
    runs the model's backward), "entropy" and "clipped" (0-dim sums over the K tokens of the
    entropy and of the loss's count, on the device). Sequence parallel (mb.local): the sums and
    the loss are this rank's tokens', the logprobs every token's (one all-gather in the
    group)."""
    head, out = model.get_output_embeddings(), {}

    def forward(self, hidden):  # (B, T, H) in place of (B, T, V) logits
        if objective is None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            out.update(_logp_pass(flat.index_select(0, mb.rows), self.weight, self.bias,
                                  mb.targets, how, top_k, entropy))
            return out["logp"]
        return _FusedOutputLayer.apply(hidden, self.weight, self.bias, mb, how, objective, out)

    head.forward = types.MethodType(forward, head)
    try:
        result = model(**mb.inputs, use_cache=False)
    finally:
        del head.forward
    if objective is not None:
        out["loss"] = result.logits
    if mb.local is not None:  # sequence parallel: every token's, from the group's ranks
        for name in ("logp", "top_logp", "top_ids", "entropy"):
            if name in out and out[name].dim():
                out[name] = seq_parallel.gather_tokens(out[name], mb.bounds, mb.split)
    return out


def hold_gathered(model, hold: bool) -> None:
    """Whether the FSDP2 units that stay gathered from forward to backward anyway (the root, and
    every unit under reshard_after_forward=False) also stay gathered after this backward, for the
    next micro-batch of the same optimizer step. FSDP2 casts a unit's fp32 shards to the compute
    dtype each time it gathers them (at one rank too: a copy in place of the all-gather; torch
    2.13, _fsdp_param.py all_gather_inputs, _fsdp_param_group.py wait_for_unshard); held, the next
    forward neither casts nor gathers them, at no cost in peak memory. Units resharded after
    forward (ZeRO-3) are left as they are: gathering again is what frees their memory. Call it
    after a forward (FSDP2 makes the root at the first one), with hold=False before the step's
    last backward."""
    for m in model.modules():
        if not hasattr(m, "set_reshard_after_backward"):  # not an FSDP2 unit
            continue
        # torch 2.13 _fsdp_param_group.py: post_forward_mesh_info None = kept after forward
        if all(g.post_forward_mesh_info is None for g in fsdp_param_groups(m)):
            m.set_reshard_after_backward(not hold, recurse=False)


def fsdp_param_groups(unit) -> list:
    """An FSDP2 unit's parameter groups, whatever the torch version: a list,
    `FSDPState._fsdp_param_groups`, in torch 2.13 (FSDP2's _fsdp_state.py, where the
    singular name is kept as a property that refuses several groups); one group or None,
    `_fsdp_param_group`, in torch 2.10 and 2.11, which have no list (read in torch 2.10.0's
    wheel)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def per_sample(found: list, n: int) -> list:
    """[(sample indices, (K, ...) values on the device, response lengths)], one entry per
    micro-batch -> n (n_i, ...) host tensors, one per sample, from one copy off the device."""
    out = [torch.zeros(0)] * n
    if not found:
        return out
    flat = torch.cat([logp for _, logp, _ in found]).cpu()  # the one read back
    for (idx, _, lengths), part in zip(found, flat.split([sum(x) for *_, x in found])):
        for i, logp in zip(idx, part.split(lengths)):
            out[i] = logp
    return out


@torch.no_grad()
def sample_logprobs(model, samples: list, how: Passes, replay: bool = False,
                    split=None) -> list:
    """Each sample's response-token logprobs under `model` (old or reference policy): a list of
    (n_i,) fp32 CPU tensors; replay and split: sample_pass's."""
    return sample_pass(model, samples, how, replay=replay, split=split)["logp"]


@torch.no_grad()
def sample_top_k(model, samples: list, how: Passes, k: int, replay: bool = False,
                 split=None) -> tuple:
    """sample_logprobs, and at each response token the k most likely tokens too: (logprobs,
    their (n_i, k) logprobs, their (n_i, k) ids), per-sample lists of CPU tensors (None at
    k 0)."""
    found = sample_pass(model, samples, how, k, replay=replay, split=split)
    return found["logp"], found.get("top_logp"), found.get("top_ids")


@torch.no_grad()
def sample_pass(model, samples: list, how: Passes, top_k: int = 0, entropy: bool = False,
                replay: bool = False, split=None) -> dict:
    """One pass without gradient over the samples: {"logp": each sample's (n_i,) fp32 response-
    token logprobs}, with top_k > 0 "top_logp" and "top_ids" ((n_i, k) each: every token's k
    most likely tokens), with entropy "entropy" ((n_i,): its sampling distribution's); lists of
    CPU tensors, each from one read back. replay: a mixture of experts
    routes by the samples' routing where they carry it (moe.routing; the actor's passes, not a
    reference's). split: the seq_parallel.Split whose ranks hold these same samples, each
    running its share of every row (a model built with model.sp_size), or None."""
    model.eval()
    found, shared = {}, sharing(samples, how)
    for idx in micro_batch_plan(samples, how.micro_batch_tokens, how.pack, model.config, split,
                                shared):
        batch = [samples[i] for i in idx] or [DUMMY]
        mb = to_device(micro_batch(batch, how.pad_id, how.pack, model.config, split, shared),
                       how.device)
        with moe.routing(model, mb.routing if replay else None):
            out = run(model, mb, how, top_k=top_k, entropy=entropy)
        for name, x in out.items():
            found.setdefault(name, []).append((idx, x, mb.lengths))
    return {name: per_sample(x, len(samples)) for name, x in found.items()}
