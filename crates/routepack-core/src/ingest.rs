//! Routing-replay ingestion: top-k expert ids per token → per-sample per-layer expert demand.
//!
//! Input is the layout verl, slime and vLLM record: `routed [T, L, k]` (uint8, int16, int32 or
//! int64 ids, row-major) with `cu_seqlens [S+1]` token offsets of the samples, and optionally
//! which rows of the layer axis are MoE layers (`moe_layers`: a model with dense layers records
//! zero rows for them). Output is the window's `expert_tokens [S, L', E]`, one row per MoE layer
//! (L' = L without `moe_layers`), counted straight into the narrowest type its counts fit
//! ([`OwnedCounts`]: uint8, uint16 or int32; never an int32 intermediate when they fit less).
//! Samples are counted in parallel (each writes its own `[L, E]` block), so the result is
//! identical for any thread count.

use rayon::prelude::*;

use crate::counts::{Count, Counts, OwnedCounts};
use crate::error::{invalid, Result};
use crate::sizes;

/// An expert id type as recorded by a rollout engine.
pub trait ExpertId: Copy + Send + Sync {
    /// The id as an unsigned index; negative ids map to values >= any E (then refused).
    fn index(self) -> u64;
    /// The id as written, for error messages.
    fn value(self) -> i64;
}

macro_rules! expert_id {
    ($($t:ty),*) => {$(
        impl ExpertId for $t {
            #[inline(always)]
            fn index(self) -> u64 { self as i64 as u64 }
            #[inline(always)]
            fn value(self) -> i64 { self as i64 }
        }
    )*};
}
expert_id!(u8, i16, i32, i64);

/// Most tokens one sample may have: `expert_tokens` is int32, and a (sample, layer, expert)
/// count is at most the sample's length (a token picks an expert at most once, which
/// `expert_tokens_from_routed` checks), so this bound is what keeps every count from wrapping.
pub const MAX_SAMPLE_TOKENS: i64 = i32::MAX as i64;

/// Checks `cu_seqlens` against T tokens: starts at 0, strictly increasing, ends at T, and no
/// sample longer than [`MAX_SAMPLE_TOKENS`].
pub fn check_cu_seqlens(cu_seqlens: &[i64], num_tokens: usize) -> Result<()> {
    if cu_seqlens.len() < 2 {
        return Err(invalid("cu_seqlens", format!("needs S+1 >= 2 entries, got {}", cu_seqlens.len())));
    }
    if cu_seqlens[0] != 0 {
        return Err(invalid("cu_seqlens", format!("must start at 0, got {}", cu_seqlens[0])));
    }
    if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] <= w[0]) {
        return Err(invalid(
            "cu_seqlens",
            format!("sample {i} is empty or negative: cu_seqlens[{i}] = {}, cu_seqlens[{}] = {}", cu_seqlens[i], i + 1, cu_seqlens[i + 1]),
        ));
    }
    // strictly increasing from 0, so every difference is positive and cannot overflow
    if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] - w[0] > MAX_SAMPLE_TOKENS) {
        return Err(invalid(
            "cu_seqlens",
            format!(
                "sample {i} has {} tokens, more than the {MAX_SAMPLE_TOKENS} an int32 expert count can hold",
                cu_seqlens[i + 1] - cu_seqlens[i]
            ),
        ));
    }
    let last = *cu_seqlens.last().unwrap();
    if last != num_tokens as i64 {
        return Err(invalid("cu_seqlens", format!("ends at {last} but routed has T = {num_tokens} tokens")));
    }
    Ok(())
}

/// Tokens counted between two flushes of the tagged counters (see [`count_tokens`]): a
/// counter's low 16 bits hold its count, which grows by at most one per token.
const FLUSH_TOKENS: usize = u16::MAX as usize;

/// What [`count_tokens`] stopped at: token `t` of its slice.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BadToken {
    /// Id number `j` of the token (layer `j / k`) is outside [0, E).
    OutOfRange { t: usize, j: usize },
    /// The token's top-k lists one expert twice in some layer.
    Duplicate { t: usize },
    /// The worker's counters could not be allocated.
    NoMemory,
}

/// Counts every counted id of `ids` (`[tokens, L, k]` flattened, `per_token` = L·k ids a
/// token, at most [`FLUSH_TOKENS`] tokens) into `counters[base[j] + id]`, `j` the id's place
/// among the token's counted ids: all of them (`pick` None) or those at the token positions
/// `pick` lists (the MoE layers' ids); on the first id outside [0, e_max), or the first token
/// whose top-k lists an expert twice in a counted layer, returns that instead (`j` as above).
///
/// Each counter is tagged: its high 16 bits hold 1 + the index of the last token that
/// counted into it, its low 16 bits the count. A token reading its own tag back has named
/// that (layer, expert) twice. This finds duplicates exactly for any k and E at the cost of
/// a few ALU operations on the counter the count reads and writes anyway (an exact pairwise
/// or bitmask test per token measured 2-4x slower on k = 8, E = 256). Without duplicates a
/// counter grows by at most one per token, so the count never carries into the tag.
///
/// Panics unless `ids` holds at most [`FLUSH_TOKENS`] tokens, every base offset leaves room
/// for `e_max` counters (`base[j] + e_max <= counters.len()`), and `pick` (when given) has one
/// position per base offset, each below `per_token`. These are checked once per call, before
/// the loop: they are what make the unchecked accesses inside it sound and the tags distinct,
/// whatever the caller passes.
fn count_tokens<T: ExpertId>(
    ids: &[T],
    per_token: usize,
    pick: Option<&[usize]>,
    base: &[usize],
    e_max: u64,
    counters: &mut [u32],
) -> Option<BadToken> {
    assert!(ids.len() / per_token <= FLUSH_TOKENS, "count_tokens: more than {FLUSH_TOKENS} tokens");
    let room = |b: usize| usize::try_from(e_max).ok().and_then(|e| b.checked_add(e)).is_some_and(|end| end <= counters.len());
    assert!(base.iter().all(|&b| room(b)), "count_tokens: a base offset leaves no room for {e_max} counters");
    let tokens = ids.chunks_exact(per_token);
    match pick {
        // one monomorphised loop each: the all-layers loop reads a token's ids in order, as before
        None => {
            assert_eq!(base.len(), per_token, "count_tokens: one base offset per id");
            count_loop(tokens, |tok| tok.iter().copied(), base, e_max, counters)
        }
        Some(pick) => {
            assert!(pick.len() == base.len() && pick.iter().all(|&q| q < per_token), "count_tokens: a position outside the token");
            count_loop(tokens, |tok| pick.iter().map(move |&q| tok[q]), base, e_max, counters)
        }
    }
}

/// The loop of [`count_tokens`] over `tokens`, reading each token's counted ids with `read`.
#[inline(always)]
fn count_loop<'a, T: ExpertId + 'a, I: Iterator<Item = T>>(
    tokens: impl Iterator<Item = &'a [T]>,
    read: impl Fn(&'a [T]) -> I,
    base: &[usize],
    e_max: u64,
    counters: &mut [u32],
) -> Option<BadToken> {
    for (t, tok) in tokens.enumerate() {
        // t < FLUSH_TOKENS (asserted by the caller), so the tag fits the high half and differs per token
        let tag = (t as u32 + 1) << 16;
        let mut seen = 0u32;
        for (j, (id, &b)) in read(tok).zip(base).enumerate() {
            let i = id.index();
            if i >= e_max {
                return Some(BadToken::OutOfRange { t, j });
            }
            // SAFETY: `i < e_max` (tested just above) and `b + e_max <= counters.len()` without
            // overflow (asserted by `count_tokens` for every base offset before the loop), so
            // `b + i < counters.len()`: the index is in bounds and the addition cannot overflow.
            let c = unsafe { counters.get_unchecked_mut(b + i as usize) };
            seen = seen.max(*c);
            // count <= t before this token (one per earlier token at most): no carry
            *c = (*c & 0xffff) + 1 + tag;
        }
        // earlier tokens left tags < tag (and counts < 2^16); only a repeat reads its own
        if seen >= tag {
            return Some(BadToken::Duplicate { t });
        }
    }
    None
}

/// The first (layer, position, position, id) at which one token's ids `tok` (`[L, k]`)
/// repeat an id in one of the counted `layers` (rows of the layer axis); the slow, exact
/// locator behind a duplicate [`count_tokens`] found.
fn locate_duplicate<T: ExpertId>(tok: &[T], top_k: usize, layers: &[usize]) -> Option<(usize, usize, usize, i64)> {
    layers.iter().find_map(|&l| {
        let sel = tok.get(l * top_k..(l + 1) * top_k)?;
        (1..sel.len()).find_map(|j| sel[..j].iter().position(|y| y.index() == sel[j].index()).map(|i| (l, i, j, sel[j].value())))
    })
}

/// Checks `moe_layers` (the rows of a `[T, L, k]` layer axis that are MoE layers): at least
/// one, each in [0, L), strictly increasing.
pub fn check_moe_layers(moe_layers: &[usize], num_layers: usize) -> Result<()> {
    if moe_layers.is_empty() {
        return Err(invalid("moe_layers", "lists no layer; a window needs at least one MoE layer".to_string()));
    }
    if let Some(&l) = moe_layers.iter().find(|&&l| l >= num_layers) {
        return Err(invalid("moe_layers", format!("lists layer {l}, but routed has L = {num_layers} layers (rows 0..{num_layers})")));
    }
    if let Some(i) = moe_layers.windows(2).position(|w| w[1] <= w[0]) {
        return Err(invalid(
            "moe_layers",
            format!("must be strictly increasing: moe_layers[{i}] = {}, moe_layers[{}] = {}", moe_layers[i], i + 1, moe_layers[i + 1]),
        ));
    }
    Ok(())
}

/// Counts `routed [T, L, k]` into `(seq_lens [S], expert_tokens [S, L', E])`, the counts in the
/// narrowest type that holds them (uint8 when every count is <= 255, uint16 when <= 65,535,
/// else int32). `moe_layers` (None: every row) lists the rows of the layer axis to count, the
/// MoE layers, strictly increasing ([`check_moe_layers`]); row i of the output's layer axis is
/// `moe_layers[i]`, and the other rows (a dense layer's zero filler) are not read at all.
///
/// Refused, naming the token (and its sample) and layer (its row in `routed`): an id outside
/// [0, E) in a counted layer, and a token
/// whose top-k lists one expert twice (a router picks k distinct experts; a repeated id would
/// count one token twice for one expert, more than the sample's length allows). A sample
/// longer than [`MAX_SAMPLE_TOKENS`] is refused before anything is counted. So every count is
/// at most its sample's length: counting into the type that holds the longest sample's
/// length cannot wrap, and a final pass narrows further when the counts allow.
pub fn expert_tokens_from_routed<T: ExpertId>(
    routed: &[T],
    num_layers: usize,
    top_k: usize,
    cu_seqlens: &[i64],
    num_experts: usize,
    moe_layers: Option<&[usize]>,
) -> Result<(Vec<i64>, OwnedCounts)> {
    if num_layers == 0 || top_k == 0 {
        return Err(invalid("routed", format!("needs L >= 1 and k >= 1, got L={num_layers}, k={top_k}")));
    }
    if num_experts == 0 || num_experts > i32::MAX as usize {
        return Err(invalid("num_experts", format!("must be in [1, 2^31), got {num_experts}")));
    }
    let per_token = num_layers.checked_mul(top_k).ok_or_else(|| invalid("routed", format!("L*k = {num_layers}*{top_k} overflows")))?;
    if !routed.len().is_multiple_of(per_token) {
        return Err(invalid("routed", format!("{} ids is not a multiple of L*k = {per_token}", routed.len())));
    }
    let t_n = routed.len() / per_token;
    check_cu_seqlens(cu_seqlens, t_n)?;
    if let Some(m) = moe_layers {
        check_moe_layers(m, num_layers)?;
    }
    // the counted rows: every row when all are MoE layers (the fast path reads ids in order)
    let moe_layers = moe_layers.filter(|m| m.len() < num_layers);
    let counted = moe_layers.map_or(num_layers, <[usize]>::len);
    let block =
        counted.checked_mul(num_experts).ok_or_else(|| invalid("num_experts", format!("L*E = {counted}*{num_experts} overflows")))?;
    let longest = cu_seqlens.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    check_count_call(cu_seqlens.len() - 1, block, counted * top_k, longest, num_experts, counted)?;
    let args = Args { routed, per_token, top_k, cu_seqlens, num_experts, block, moe_layers };
    let counts = if longest <= u8::MAX as i64 {
        OwnedCounts::U8(count_into(&args)?)
    } else if longest <= u16::MAX as i64 {
        OwnedCounts::U16(count_into(&args)?)
    } else {
        OwnedCounts::I32(count_into(&args)?)
    };
    Ok((cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect(), counts.into_narrowest()))
}

/// Reserves what [`expert_tokens_from_routed`] holds at once ([`sizes::check_call`], naming
/// `num_experts`, which sizes it): the counts `[S, L, E]` in the width the longest sample
/// needs, their narrowed copy (at most half as wide), per worker one sample's `[L, E]` u32
/// counters and `L·k` offsets, and the lengths.
fn check_count_call(s_n: usize, block: usize, per_token: usize, longest: i64, num_experts: usize, num_layers: usize) -> Result<()> {
    let width: u128 = if longest <= u8::MAX as i64 {
        1
    } else if longest <= u16::MAX as i64 {
        2
    } else {
        4
    };
    let counts = sizes::table_bytes(&[s_n, block], 1).saturating_mul(width);
    let per_worker = sizes::bytes_of::<u32>(block).saturating_add(sizes::bytes_of::<usize>(per_token));
    let bytes = counts
        .saturating_add(counts / 2)
        .saturating_add(per_worker.saturating_mul(rayon::current_num_threads().min(s_n) as u128))
        .saturating_add(sizes::bytes_of::<i64>(s_n));
    let what = format!("the counts [S, L, E] = [{s_n}, {num_layers}, {num_experts}] (with their narrowed copy and each worker's counters)");
    sizes::check_call("num_experts", &what, bytes)
}

/// The checked arguments of [`expert_tokens_from_routed`].
struct Args<'a, T> {
    routed: &'a [T],
    per_token: usize,
    top_k: usize,
    cu_seqlens: &'a [i64],
    num_experts: usize,
    block: usize,
    /// The counted rows of the layer axis, when not every row (`expert_tokens_from_routed`).
    moe_layers: Option<&'a [usize]>,
}

/// The counts `[S, L, E]` in `C`, which must hold the longest sample's length.
fn count_into<T: ExpertId, C: Count>(a: &Args<'_, T>) -> Result<Vec<C>> {
    let Args { routed, per_token, top_k, cu_seqlens, num_experts, block, moe_layers } = *a;
    let (s_n, num_layers) = (cu_seqlens.len() - 1, block / num_experts);
    // the token positions of the counted ids (None: all, in order); counted id j goes to row j / k
    let pick: Option<Vec<usize>> = moe_layers.map(|m| m.iter().flat_map(|&l| l * top_k..(l + 1) * top_k).collect());
    let counted_ids = num_layers * top_k;
    let e_max = num_experts as u64;
    let mut counts = Vec::new();
    block
        .checked_mul(s_n)
        .and_then(|n| counts.try_reserve_exact(n).ok().map(|_| n))
        .map(|n| counts.resize(n, C::default()))
        .ok_or_else(|| invalid("num_experts", format!("S*L*E = {s_n}*{num_layers}*{num_experts} counts cannot be allocated")))?;
    // each sample fills its own [L, E] block; errors are reported for the lowest sample
    let first_error = counts
        .par_chunks_mut(block)
        .enumerate()
        .map_init(Vec::<u32>::new, |local, (s, out)| {
            let (lo, hi) = (cu_seqlens[s] as usize, cu_seqlens[s + 1] as usize);
            let ids = &routed[lo * per_token..hi * per_token];
            // flat offsets: counted id j of a token counts in row (j / k) of this sample's [L', E] block
            let base: Vec<usize> = (0..counted_ids).map(|j| (j / top_k) * num_experts).collect();
            local.clear();
            // the worker's counters, fallibly (the call's estimate counted them)
            if local.try_reserve_exact(out.len()).is_err() {
                return Some((s, lo, BadToken::NoMemory));
            }
            local.resize(out.len(), 0);
            for (c, chunk) in ids.chunks(FLUSH_TOKENS * per_token).enumerate() {
                if let Some(bad) = count_tokens(chunk, per_token, pick.as_deref(), &base, e_max, local) {
                    return Some((s, lo + c * FLUSH_TOKENS, bad));
                }
                // the sample has at most C::MAX tokens and each adds at most one here
                for (o, l) in out.iter_mut().zip(local.iter_mut()) {
                    *o = C::narrow(o.wide() + i64::from(*l & 0xffff));
                    *l = 0;
                }
            }
            None
        })
        .collect::<Vec<_>>()
        .into_iter()
        .flatten()
        .next();
    match first_error {
        Some((_, _, BadToken::NoMemory)) => {
            Err(invalid("num_experts", format!("a worker's counters [L, E] = [{num_layers}, {num_experts}] of uint32 cannot be allocated")))
        }
        Some((s, first, BadToken::OutOfRange { t, j })) => {
            // j counts the token's counted ids: its position in the token is pick[j] (or j)
            let q = pick.as_ref().map_or(j, |p| p[j]);
            let id = routed[(first + t) * per_token + q].value();
            Err(invalid(
                "routed",
                format!("expert id {id} at token {} (sample {s}), layer {} is outside [0, {num_experts})", first + t, q / top_k),
            ))
        }
        Some((s, first, BadToken::Duplicate { t })) => {
            let tok = &routed[(first + t) * per_token..(first + t + 1) * per_token];
            let rows: Vec<usize> = moe_layers.map_or_else(|| (0..per_token / top_k).collect(), <[usize]>::to_vec);
            // count_tokens only reports a token that repeats an id in one counted layer, so the
            // locator always finds it; the fallback keeps even a broken invariant panic-free
            let what = match locate_duplicate(tok, top_k, &rows) {
                Some((l, i, j, id)) => format!("layer {l} lists expert {id} twice (positions {i} and {j} of its top-{top_k})"),
                None => "repeats an expert in one layer".to_string(),
            };
            Err(invalid("routed", format!("token {} (sample {s}), {what}; a token picks {top_k} distinct experts", first + t)))
        }
        None => Ok(counts),
    }
}

/// Checks that a window's counts are possible for its lengths, in one parallel pass over
/// `expert_tokens [S, L, E]`: no count negative, none above its sample's length (a token
/// picks an expert at most once), and with `top_k` known, no layer's counts adding up to
/// more than `seq_len · top_k`. Names the first offending (sample, layer[, expert]) in
/// sample order. `seq_lens` must hold S lengths and `expert_tokens` S·L·E counts (int32,
/// uint16 or uint8; only int32 can be negative); `top_k` lies in [1, E]. Returns the largest
/// count (0 for an all-zero window), which picks the narrowest type that holds them.
pub fn check_expert_tokens<'a>(
    seq_lens: &[i64],
    expert_tokens: impl Into<Counts<'a>>,
    num_layers: usize,
    num_experts: usize,
    top_k: Option<usize>,
) -> Result<i64> {
    let expert_tokens = expert_tokens.into();
    let block = num_layers.checked_mul(num_experts).filter(|&b| b > 0);
    let Some(block) = block.filter(|b| b.checked_mul(seq_lens.len()) == Some(expert_tokens.len())) else {
        return Err(invalid(
            "expert_tokens",
            format!("has {} entries, expected S*L*E = {}*{num_layers}*{num_experts} with L, E >= 1", expert_tokens.len(), seq_lens.len()),
        ));
    };
    if let Some(k) = top_k.filter(|&k| k == 0 || k > num_experts) {
        return Err(invalid("top_k", format!("must be in [1, E = {num_experts}] (a token picks distinct experts), got {k}")));
    }
    let per_sample = crate::with_counts!(expert_tokens, x => check_rows(x, seq_lens, block, num_experts, top_k));
    // the first offender in sample order, else the largest count
    let mut top = 0;
    for r in per_sample {
        top = top.max(r.map_err(|msg| invalid("expert_tokens", msg))?);
    }
    Ok(top)
}

/// Per sample of `counts` (`[S, L, E]` in blocks of `block`): its largest count, or the
/// message naming its first impossible row (see [`check_expert_tokens`]).
fn check_rows<C: Count>(
    counts: &[C],
    seq_lens: &[i64],
    block: usize,
    num_experts: usize,
    top_k: Option<usize>,
) -> Vec<std::result::Result<i64, String>> {
    counts
        .par_chunks(block)
        .zip(seq_lens.par_iter())
        .enumerate()
        .map(|(s, (counts, &n))| {
            let mut top = 0i64;
            let bad = counts.chunks_exact(num_experts).enumerate().find_map(|(l, row)| {
                // one vectorisable sweep per row; the expert is located only on a violation
                // (min and max in the stored type: the sweep vectorises as it did for int32 alone)
                let (mut lo, mut hi, mut sum) = (C::HIGHEST, C::LOWEST, 0i64);
                for &c in row {
                    lo = lo.min(c);
                    hi = hi.max(c);
                    sum += c.wide();
                }
                let (lo, hi) = (lo.wide(), hi.wide());
                top = top.max(hi);
                let at = |v: i64| row.iter().position(|&c| c.wide() == v).unwrap_or(0);
                if lo < 0 {
                    return Some(format!("negative count {lo} at sample {s}, layer {l}, expert {}", at(lo)));
                }
                if hi > n {
                    return Some(format!(
                        "sample {s}, layer {l}, expert {} has {hi} tokens but the sample's length is {n}; a token \
                     picks an expert at most once",
                        at(hi)
                    ));
                }
                // sum <= E * i32::MAX < 2^62; sum > n·k  <=>  ceil(sum / k) > n, which cannot overflow
                // without top_k nothing bounds the sum: no violation in this row
                let k = top_k? as i64; // in [1, E], checked above
                ((sum + k - 1) / k > n).then(|| {
                    format!(
                        "sample {s}, layer {l} has {sum} tokens over its experts, more than seq_len * top_k = {n} * {k}; \
                     each token picks top_k experts"
                    )
                })
            });
            bad.map_or(Ok(top), Err)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_past_the_u16_flush() {
        // 140 000 tokens of one sample, k = 2, every token picks expert 3 and one of 0..3:
        // 140 000 counts in one counter, two u16 flushes
        let t = 140_000usize;
        let mut routed: Vec<i32> = (0..t).flat_map(|i| [3, (i % 3) as i32]).collect();
        let (lens, c) = expert_tokens_from_routed(&routed, 1, 2, &[0, t as i64], 4, None).unwrap();
        let third = (t / 3) as i32; // t = 3 * 46 666 + 2: experts 0 and 1 get one more
                                    // the longest count is 140 000: int32, the only type that holds it
        assert_eq!((lens, c), (vec![t as i64], OwnedCounts::I32(vec![third + 1, third + 1, third, t as i32])));
        // a bad id after the first flush is still located exactly
        routed[70_000 * 2 + 1] = 7;
        let e = expert_tokens_from_routed(&routed, 1, 2, &[0, t as i64], 4, None).unwrap_err();
        assert!(e.to_string().contains("expert id 7 at token 70000 (sample 0), layer 0"), "{e}");
        // and so is a duplicate
        routed[70_000 * 2 + 1] = 0;
        routed[100_001 * 2 + 1] = 3;
        let e = expert_tokens_from_routed(&routed, 1, 2, &[0, t as i64], 4, None).unwrap_err();
        assert!(e.to_string().contains("token 100001 (sample 0), layer 0 lists expert 3 twice"), "{e}");
    }

    #[test]
    fn names_duplicates_and_long_samples() {
        // L = 2, k = 3: token 1 of sample 1 repeats expert 4 in layer 1
        let mut routed: Vec<u8> = [0u8, 1, 2, 3, 4, 5].repeat(3);
        routed[2 * 6 + 3 + 2] = 3;
        let e = expert_tokens_from_routed(&routed, 2, 3, &[0, 1, 3], 6, None).unwrap_err();
        assert!(e.to_string().contains("token 2 (sample 1), layer 1 lists expert 3 twice (positions 0 and 2"), "{e}");
        let long = MAX_SAMPLE_TOKENS + 1;
        let e = check_cu_seqlens(&[0, 5, 5 + long], (5 + long) as usize).unwrap_err();
        assert!(e.to_string().contains(&format!("sample 1 has {long} tokens")), "{e}");
        assert!(check_cu_seqlens(&[0, MAX_SAMPLE_TOKENS], MAX_SAMPLE_TOKENS as usize).is_ok());
    }

    #[test]
    fn impossible_counts_are_named() {
        // S = 2, L = 2, E = 3; sample 1 (length 2) has 3 tokens on expert 2 in layer 1
        let lens = [4i64, 2];
        let mut c = vec![1i32, 2, 1, 4, 0, 0, 1, 1, 0, 0, 0, 3];
        let e = check_expert_tokens(&lens, &c, 2, 3, None).unwrap_err();
        assert!(e.to_string().contains("sample 1, layer 1, expert 2 has 3 tokens but the sample's length is 2"), "{e}");
        c[11] = 2;
        assert_eq!(check_expert_tokens(&lens, &c, 2, 3, None).unwrap(), 4);
        let narrow: Vec<u8> = c.iter().map(|&x| x as u8).collect();
        assert_eq!(check_expert_tokens(&lens, &narrow, 2, 3, None).unwrap(), 4);
        // with k = 1, sample 0's layer 0 (4 tokens) holds 1 + 2 + 1 = 4: fine; sample 1's layer 1 holds 2
        assert!(check_expert_tokens(&lens, &c, 2, 3, Some(1)).is_ok());
        c[6] = 2; // sample 1, layer 0: 2 + 1 + 0 = 3 > 2 * 1
        let e = check_expert_tokens(&lens, &c, 2, 3, Some(1)).unwrap_err();
        assert!(e.to_string().contains("sample 1, layer 0 has 3 tokens over its experts, more than seq_len * top_k = 2 * 1"), "{e}");
        c[4] = -1;
        let e = check_expert_tokens(&lens, &c, 2, 3, None).unwrap_err();
        assert!(e.to_string().contains("negative count -1 at sample 0, layer 1, expert 1"), "{e}");
        assert!(check_expert_tokens(&lens, &c[1..], 2, 3, None).is_err());
        assert!(check_expert_tokens(&lens, &c, 2, 3, Some(4)).is_err());
        assert!(check_expert_tokens(&lens, &c, 2, 3, Some(0)).is_err());
    }

    #[test]
    fn counts_only_the_moe_layers() {
        // L = 3 rows, k = 2: row 0 is a dense layer (zero filler: "expert 0 twice"), rows 1, 2 MoE
        let routed: Vec<i16> = vec![0, 0, 1, 2, 3, 0, /* token 1 */ 0, 0, 2, 3, 1, 3];
        let e = expert_tokens_from_routed(&routed, 3, 2, &[0, 2], 4, None).unwrap_err();
        assert!(e.to_string().contains("token 0 (sample 0), layer 0 lists expert 0 twice"), "{e}");
        let (lens, c) = expert_tokens_from_routed(&routed, 3, 2, &[0, 2], 4, Some(&[1, 2])).unwrap();
        assert_eq!(lens, vec![2]);
        // [S=1, L'=2, E=4]: MoE row 1 counts {1, 2} and {2, 3}; row 2 counts {3, 0} and {1, 3}
        assert_eq!(c, OwnedCounts::U8(vec![0, 1, 2, 1, 1, 1, 0, 2]));
        // every row listed takes the all-rows path: the dense row is counted, and refused
        assert!(expert_tokens_from_routed(&routed, 3, 2, &[0, 2], 4, Some(&[0, 1, 2])).is_err());
        // errors name the row of routed's layer axis
        let mut bad = routed.clone();
        bad[6 + 2 * 2 + 1] = 9; // token 1, row 2, position 1
        let e = expert_tokens_from_routed(&bad, 3, 2, &[0, 2], 4, Some(&[1, 2])).unwrap_err();
        assert!(e.to_string().contains("expert id 9 at token 1 (sample 0), layer 2"), "{e}");
        bad[6 + 2 * 2 + 1] = 1;
        let e = expert_tokens_from_routed(&bad, 3, 2, &[0, 2], 4, Some(&[1, 2])).unwrap_err();
        assert!(e.to_string().contains("token 1 (sample 0), layer 2 lists expert 1 twice"), "{e}");
        // a garbage id in a dense row is never read
        let mut dense = routed.clone();
        dense[0] = -7;
        assert!(expert_tokens_from_routed(&dense, 3, 2, &[0, 2], 4, Some(&[1, 2])).is_ok());
        for (m, want) in
            [(&[][..], "lists no layer"), (&[1, 3][..], "lists layer 3, but routed has L = 3"), (&[2, 1][..], "strictly increasing")]
        {
            let e = expert_tokens_from_routed(&routed, 3, 2, &[0, 2], 4, Some(m)).unwrap_err();
            assert!(e.to_string().contains(want) && e.to_string().starts_with("moe_layers"), "{e}");
        }
    }

    #[test]
    fn counts_and_names_bad_ids() {
        // 3 tokens, L=1, k=2, two samples [0,2) and [2,3)
        let routed: Vec<u8> = vec![0, 1, 1, 2, 2, 0];
        let (lens, c) = expert_tokens_from_routed(&routed, 1, 2, &[0, 2, 3], 3, None).unwrap();
        assert_eq!(lens, vec![2, 1]);
        assert_eq!(c, OwnedCounts::U8(vec![1, 2, 1, 1, 0, 1]));
        let e = expert_tokens_from_routed(&routed, 1, 2, &[0, 2, 3], 2, None).unwrap_err();
        assert!(e.to_string().contains("expert id 2 at token 1 (sample 0), layer 0"), "{e}");
        let neg: Vec<i16> = vec![0, -1];
        let e = expert_tokens_from_routed(&neg, 1, 2, &[0, 1], 4, None).unwrap_err();
        assert!(e.to_string().contains("expert id -1"), "{e}");
        assert!(expert_tokens_from_routed(&routed, 1, 2, &[0, 3, 3], 3, None).is_err());
    }
}
