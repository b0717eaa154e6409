//! Property tests of `ingest`: counts equal a naive count for every id type, a bad id and a
//! repeated id inside one token are named exactly, every count stays within its sample's
//! length, rows outside `moe_layers` are never read, malformed input gives `Err`, never a panic.

mod common;

use common::{usizes, Mix};
use proptest::prelude::*;
use routepack_core::ingest::{check_cu_seqlens, expert_tokens_from_routed, ExpertId, MAX_SAMPLE_TOKENS};
use routepack_core::OwnedCounts;

/// Whether `c` is stored in the narrowest type holding its largest count.
fn is_narrowest(c: &OwnedCounts) -> bool {
    let top = c.to_i32_vec().into_iter().max().unwrap_or(0);
    match c {
        OwnedCounts::U8(_) => top <= 255,
        OwnedCounts::U16(_) => (256..=65535).contains(&top),
        OwnedCounts::I32(_) => top > 65535,
    }
}

fn naive_count<T: ExpertId>(routed: &[T], layers: usize, k: usize, cu: &[i64], experts: usize) -> Vec<i32> {
    let s_n = cu.len() - 1;
    let mut out = vec![0i32; s_n * layers * experts];
    for s in 0..s_n {
        for t in cu[s] as usize..cu[s + 1] as usize {
            for l in 0..layers {
                for j in 0..k {
                    let id = routed[(t * layers + l) * k + j].value() as usize;
                    out[(s * layers + l) * experts + id] += 1;
                }
            }
        }
    }
    out
}

/// Ingests and checks the counts against `naive_count`, and what every valid window must
/// satisfy: a count is at most its sample's length, a layer's counts add up to length · k.
fn check_ingest<T: ExpertId + std::fmt::Debug>(
    ids: &[T],
    layers: usize,
    k: usize,
    cu: &[i64],
    experts: usize,
) -> Result<(), TestCaseError> {
    let (lens, owned) = expert_tokens_from_routed(ids, layers, k, cu, experts, None).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(is_narrowest(&owned));
    let counts = owned.to_i32_vec();
    prop_assert_eq!(&lens, &cu.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>());
    for (s, &n) in lens.iter().enumerate() {
        for l in 0..layers {
            let row = &counts[(s * layers + l) * experts..][..experts];
            prop_assert!(row.iter().all(|&c| (0..=n).contains(&i64::from(c))));
            prop_assert_eq!(row.iter().map(|&c| i64::from(c)).sum::<i64>(), n * k as i64);
        }
    }
    prop_assert_eq!(counts, naive_count(ids, layers, k, cu, experts));
    Ok(())
}

/// `tokens · layers` top-k selections of k distinct ids in [0, experts) (k <= experts).
fn distinct_ids(mix: &mut Mix, selections: usize, k: usize, experts: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..experts).collect();
    (0..selections)
        .flat_map(|_| {
            mix.shuffle(&mut all);
            all[..k].to_vec()
        })
        .collect()
}

fn cuts(mix: &mut Mix, tokens: usize) -> Vec<i64> {
    let mut cuts: Vec<i64> = (1..tokens as i64).filter(|_| mix.unit() < 0.3).collect();
    cuts.insert(0, 0);
    cuts.push(tokens as i64);
    cuts
}

fn as_dtype(raw: &[i64], dtype: usize) -> Dtyped {
    match dtype {
        0 => Dtyped::U8(raw.iter().map(|&x| x as u8).collect()),
        1 => Dtyped::I16(raw.iter().map(|&x| x as i16).collect()),
        2 => Dtyped::I32(raw.iter().map(|&x| x as i32).collect()),
        _ => Dtyped::I64(raw.to_vec()),
    }
}

enum Dtyped {
    U8(Vec<u8>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

macro_rules! with_ids {
    ($d:expr, $ids:ident => $body:expr) => {
        match $d {
            Dtyped::U8($ids) => $body,
            Dtyped::I16($ids) => $body,
            Dtyped::I32($ids) => $body,
            Dtyped::I64($ids) => $body,
        }
    };
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ingest_equals_naive_count(seed in any::<u64>(), tokens in 1usize..60, layers in 1usize..4, k in 1usize..6, experts in 1usize..200, dtype in 0usize..4) {
        let mut mix = Mix(seed);
        let experts = if dtype == 0 { experts.min(256) } else { experts }.max(k);
        let raw: Vec<i64> = distinct_ids(&mut mix, tokens * layers, k, experts).into_iter().map(|x| x as i64).collect();
        let cu = cuts(&mut mix, tokens);
        with_ids!(as_dtype(&raw, dtype), ids => check_ingest(&ids, layers, k, &cu, experts)?);
    }

    #[test]
    fn ingest_names_a_bad_id(tokens in 1usize..30, layers in 1usize..4, k in 1usize..4, at in any::<prop::sample::Index>(), bad in prop_oneof![Just(-1i64), Just(i64::MIN), 8i64..1000]) {
        // every token lists experts 0..k in each layer: valid but for the one bad id
        let mut ids: Vec<i64> = (0..tokens * layers * k).map(|i| (i % k) as i64).collect();
        let i = at.index(ids.len());
        ids[i] = bad;
        let e = expert_tokens_from_routed(&ids, layers, k, &[0, tokens as i64], 8, None).unwrap_err();
        let (t, l) = (i / (layers * k), (i / k) % layers);
        prop_assert!(e.to_string().contains(&format!("expert id {bad} at token {t} (sample 0), layer {l}")), "{}", e);
    }

    #[test]
    fn ingest_names_a_repeated_id(seed in any::<u64>(), tokens in 1usize..40, layers in 1usize..4, k in 2usize..9, extra in 0usize..40, dtype in 0usize..4, at in any::<prop::sample::Index>(), pair in any::<(prop::sample::Index, prop::sample::Index)>()) {
        // valid selections, then one (token, layer) gets position j's id copied to i != j
        let mut mix = Mix(seed);
        let experts = (k + extra).min(256);
        let mut raw: Vec<i64> = distinct_ids(&mut mix, tokens * layers, k, experts).into_iter().map(|x| x as i64).collect();
        let sel = at.index(tokens * layers);
        let (a, b) = (pair.0.index(k), pair.1.index(k - 1));
        let b = if b >= a { b + 1 } else { b };
        raw[sel * k + a] = raw[sel * k + b];
        let (t, l) = (sel / layers, sel % layers);
        let cu = cuts(&mut mix, tokens);
        let s = cu.iter().rposition(|&c| c <= t as i64).unwrap();
        let e = with_ids!(as_dtype(&raw, dtype), ids => expert_tokens_from_routed(&ids, layers, k, &cu, experts, None).unwrap_err());
        let (lo, hi) = (a.min(b), a.max(b));
        let id = raw[sel * k + a];
        prop_assert!(e.to_string().contains(&format!(
            "token {t} (sample {s}), layer {l} lists expert {id} twice (positions {lo} and {hi} of its top-{k})"
        )), "{}", e);
    }

    #[test]
    fn moe_layers_count_as_their_rows_alone(seed in any::<u64>(), tokens in 1usize..50, layers in 2usize..6, k in 1usize..5, experts in 1usize..40, dtype in 0usize..4, keep in any::<u8>(), junk in -3i64..3) {
        // rows not in moe_layers hold anything (zero filler, repeats, out-of-range ids): never read;
        // the counts equal the naive count of the MoE rows cut out into their own [T, L', k] array
        let mut mix = Mix(seed);
        let experts = experts.max(k);
        let moe: Vec<usize> = (0..layers).filter(|l| keep >> l & 1 == 1).collect();
        prop_assume!(!moe.is_empty());
        let mut raw: Vec<i64> = distinct_ids(&mut mix, tokens * layers, k, experts).into_iter().map(|x| x as i64).collect();
        for t in 0..tokens {
            for l in (0..layers).filter(|l| !moe.contains(l)) {
                raw[(t * layers + l) * k..][..k].fill(junk);
            }
        }
        let cut: Vec<i64> = (0..tokens).flat_map(|t| moe.iter().flat_map(move |&l| (0..k).map(move |j| (t, l, j)))).map(|(t, l, j)| raw[(t * layers + l) * k + j]).collect();
        let cu = cuts(&mut mix, tokens);
        let (lens, owned) = with_ids!(as_dtype(&raw, dtype), ids => expert_tokens_from_routed(&ids, layers, k, &cu, experts, Some(&moe))).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(is_narrowest(&owned));
        prop_assert_eq!(lens, cu.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>());
        prop_assert_eq!(owned.to_i32_vec(), naive_count(&cut, moe.len(), k, &cu, experts));
    }

    #[test]
    fn long_samples_are_refused_before_counting(short in 1i64..1000, over in 1i64..1_000_000, first in any::<bool>()) {
        // no routed array that long is needed: check_cu_seqlens refuses on offsets alone
        let long = MAX_SAMPLE_TOKENS + over;
        let cu = if first { vec![0, long, long + short] } else { vec![0, short, short + long] };
        let e = check_cu_seqlens(&cu, (long + short) as usize).unwrap_err();
        prop_assert!(e.to_string().contains(&format!("sample {} has {long} tokens", usize::from(!first))), "{}", e);
        prop_assert!(check_cu_seqlens(&[0, short, short + MAX_SAMPLE_TOKENS], (short + MAX_SAMPLE_TOKENS) as usize).is_ok());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ingest_never_panics(ids in prop::collection::vec(-2i32..6, 0..40), layers in usizes(), k in usizes(), cu in prop::collection::vec(-2i64..45, 0..5), experts in prop_oneof![0usize..8, Just(usize::MAX)]) {
        let _ = check_cu_seqlens(&cu, ids.len());
        if let Ok((lens, counts)) = expert_tokens_from_routed(&ids, layers, k, &cu, experts, None) {
            let counts = counts.to_i32_vec();
            prop_assert_eq!(counts.len(), lens.len() * layers * experts);
            prop_assert!(lens.iter().zip(counts.chunks(layers.max(1) * experts.max(1))).all(|(&n, c)| c.iter().all(|&x| (0..=n).contains(&i64::from(x)))));
        }
    }
}
