use super::*;

#[test]
fn pieces_split_tokens_and_counts_exactly() {
    let p = Pieces::new(&[5, 23, 10], 10, 3).unwrap();
    assert_eq!(p.first, vec![0, 1, 4, 5]);
    assert_eq!(p.lens, vec![5, 8, 8, 7, 10]);
    assert_eq!(p.sample, vec![0, 1, 1, 1, 2]);
    assert!(p.any_split() && p.is_split(1) && !p.is_split(2));
    assert_eq!(p.row_lens(10), vec![5, 10, 10, 10, 10]);
    // [S=3, L=1, E=2]; sample 1's 7 and 23 tokens split as ⌊c·T_{j+1}/n⌋ − ⌊c·T_j/n⌋
    let counts: Vec<i32> = vec![1, 2, 7, 23, 0, 4];
    let w = WindowView::new(&[5, 23, 10], &counts, 1, 2).unwrap();
    let c = p.counts(&w).unwrap();
    assert_eq!(c, vec![1, 2, 2, 8, 2, 8, 3, 7, 0, 4]);
    assert_eq!(c[2] + c[4] + c[6], 7);
    let (r, m) = p.expand(&[1, 2, 0], &[0, 1, 1]);
    assert_eq!((r, m), (vec![1, 2, 3, 4, 0], vec![0, 1, 1, 1, 1]));
}

#[test]
fn bad_splits_are_named() {
    let e = Pieces::new(&[5, 31], 10, 3).unwrap_err().to_string();
    assert!(e.contains("sample 1 has 31 tokens") && e.contains("topo.cp x token_cap = 3 x 10"), "{e}");
    let e = Pieces::new(&[3], 1, 4).unwrap_err().to_string();
    assert!(e.contains("sample 0 has 3 tokens, fewer than topo.cp = 4"), "{e}");
    let e = Pieces::new(&[5, 12], 10, 1).unwrap_err().to_string();
    assert!(e.contains("topo.cp") && e.contains("cp >= 2, got 1"), "{e}");
}

#[test]
fn align_puts_each_split_sample_on_one_group_at_one_microbatch() {
    // 4 ranks, CP groups of 2; two split samples, pieces scattered by a packer
    let p = Pieces::new(&[15, 3, 12, 4, 2, 1], 10, 2).unwrap();
    assert_eq!(p.lens.len(), 8);
    // pieces: 0,1 (sample 0), 2 (sample 1), 3,4 (sample 2), 5, 6, 7
    let (mut rank, mut micro) = (vec![1, 2, 0, 3, 0, 1, 2, 3], vec![0, 1, 0, 0, 1, 1, 0, 1]);
    align(&mut rank, &mut micro, 2, &p, 4);
    for s in [0usize, 2] {
        let k = p.first[s];
        assert_eq!(rank[k] % 2, 0, "{rank:?} {micro:?}");
        assert_eq!((rank[k + 1], micro[k + 1]), (rank[k] + 1, micro[k]), "{rank:?} {micro:?}");
    }
    // still every cell filled once
    let mut cells: Vec<i32> = rank.iter().zip(&micro).map(|(&d, &m)| d * 2 + m).collect();
    cells.sort_unstable();
    assert_eq!(cells, (0..8).collect::<Vec<_>>());
    let (r, m) = p.collapse(&rank, &micro);
    assert_eq!((r.len(), m.len()), (6, 6));
    assert_eq!((r[0], m[0]), (rank[0], micro[0]));
}
