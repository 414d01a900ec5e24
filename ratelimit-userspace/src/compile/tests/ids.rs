//! Rule ids across reloads: stable for unchanged rules, reused oldest first, rebuilt from what is
//! installed; a stale set refused and a failed swap changing nothing.

use super::*;

#[test]
fn ids_are_stable_across_reloads() {
    let mut ids = RuleIds::new();
    let v1 = vec![
        limit("a", "10.0.0.0/8", 1),
        limit("b", "11.0.0.0/8", 1),
        limit("c", "12.0.0.0/8", 1),
    ];
    let set1 = compile(&v1, &ids).unwrap();
    assert_eq!(
        set1.rules
            .iter()
            .map(|r| (r.id, r.fresh))
            .collect::<Vec<_>>(),
        [(0, true), (1, true), (2, true)]
    );
    assert_eq!(ids.commit(&set1).unwrap(), Vec::<u32>::new());

    // "a" unchanged (moving it in the file and a new source do not matter), "b" changed, "c"
    // removed, "d" added.
    let v2 = vec![
        limit("d", "13.0.0.0/8", 1),
        limit("b", "11.0.0.0/8", 2),
        RuleConfig {
            line: 40,
            ..limit("a", "10.0.0.0/9", 1)
        },
    ];
    let set2 = compile(&v2, &ids).unwrap();
    let got: Vec<_> = set2
        .rules
        .iter()
        .map(|r| (r.name.as_str(), r.id, r.fresh))
        .collect();
    // Fresh ids avoid 0..=2, which the active generation uses until the swap.
    assert_eq!(got, [("d", 3, true), ("b", 4, true), ("a", 0, false)]);
    assert_eq!(ids.commit(&set2).unwrap(), [1, 2]);
    assert_eq!(
        (ids.id_of("a"), ids.id_of("b"), ids.id_of("c")),
        (Some(0), Some(4), None)
    );

    // Recompiling the same rules changes nothing.
    let again = compile(&v2, &ids).unwrap();
    assert!(again.rules.iter().all(|r| !r.fresh));
    assert_eq!(
        again.rules.iter().map(|r| r.id).collect::<Vec<_>>(),
        [3, 4, 0]
    );
}

#[test]
fn commit_rejects_stale_sets_and_failed_swaps_change_nothing() {
    let mut ids = RuleIds::new();
    let first = compile(&[limit("a", "10.0.0.0/8", 1)], &ids).unwrap();
    // The swap of `first` failed: no commit; the next compile assigns the same ids.
    let second = compile(&[limit("a", "10.0.0.0/8", 1)], &ids).unwrap();
    assert_eq!(first.rules[0].id, second.rules[0].id);
    ids.commit(&second).unwrap();
    assert_eq!(ids.commit(&first), Err(CompileError::StaleCompile));
    assert_eq!(ids.len(), 1);
}

#[test]
fn freed_ids_are_reused_oldest_first_after_unused_ones() {
    let mut ids = RuleIds::from_installed((0..MAX_RULES - 2).map(|i| {
        (
            format!("r{i}"),
            i,
            rule_record(&limit(&format!("r{i}"), "10.0.0.0/8", 1)),
        )
    }))
    .unwrap();
    assert_eq!(ids.len(), (MAX_RULES - 2) as usize);
    // Replace r5 then r9: fresh ids come from the two never used, then from the freed ones.
    let mut rules: Vec<RuleConfig> = (0..MAX_RULES - 2)
        .filter(|&i| i != 5)
        .map(|i| {
            limit(
                &format!("r{i}"),
                &format!("10.{}.{}.0/24", i >> 8, i & 255),
                1,
            )
        })
        .collect();
    let set = compile(&rules, &ids).unwrap();
    assert!(set.rules.iter().all(|r| !r.fresh));
    assert_eq!(ids.commit(&set).unwrap(), [5]);

    rules.push(limit("new1", "11.0.0.0/8", 1));
    rules.push(limit("new2", "12.0.0.0/8", 1));
    rules.push(limit("new3", "13.0.0.0/8", 1));
    let set = compile(&rules, &ids).unwrap();
    let fresh: Vec<u32> = set.rules.iter().filter(|r| r.fresh).map(|r| r.id).collect();
    assert_eq!(fresh, [MAX_RULES - 2, MAX_RULES - 1, 5]);
    ids.commit(&set).unwrap();

    // Every id is in use: changing a rule needs a free id during the swap.
    rules[0].rate = Some(7);
    rules[0].burst = Some(7);
    let err = compile(&rules, &ids).unwrap_err();
    assert!(
        matches!(
            err,
            CompileError::OutOfIds {
                needed: 1,
                available: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn rebuild_from_installed() {
    let mut ids = RuleIds::new();
    let rules = vec![
        limit("a", "10.0.0.0/8", 1),
        limit("b", "11.0.0.0/8", 1),
        limit("c", "12.0.0.0/8", 1),
    ];
    let set = compile(&rules, &ids).unwrap();
    ids.commit(&set).unwrap();
    let set = compile(&rules[1..], &ids).unwrap();
    ids.commit(&set).unwrap();

    // A restarted agent reads (name, id, record) back from the maps.
    let restored =
        RuleIds::from_installed(set.rules.iter().map(|r| (r.name.clone(), r.id, r.rule))).unwrap();
    let changed = vec![
        limit("b", "11.0.0.0/8", 1),
        limit("c", "12.0.0.0/8", 9),
        limit("d", "14.0.0.0/8", 1),
    ];
    let next = compile(&changed, &restored).unwrap();
    let got: Vec<_> = next
        .rules
        .iter()
        .map(|r| (r.name.as_str(), r.id, r.fresh))
        .collect();
    // Ids never used (3, 4) come before the free id 0, whose leftover state may be recent.
    assert_eq!(got, [("b", 1, false), ("c", 3, true), ("d", 4, true)]);
    assert_eq!(restored.fresh_ids().take(3).collect::<Vec<_>>(), [3, 4, 5]);
    assert_eq!(restored.fresh_ids().last(), Some(0));

    let rec = Rule::default();
    let dup_id =
        RuleIds::from_installed([("a".to_owned(), 1, rec), ("b".to_owned(), 1, rec)]).unwrap_err();
    assert!(dup_id.to_string().contains("\"b\" (id 1)"), "{dup_id}");
    assert!(RuleIds::from_installed([("a".to_owned(), 1, rec), ("a".to_owned(), 2, rec)]).is_err());
    assert!(RuleIds::from_installed([("a".to_owned(), MAX_RULES, rec)]).is_err());
}
