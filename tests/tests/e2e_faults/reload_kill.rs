//! Killed in the middle of a reload: two rule sets of long deny lists, the agent killed at each
//! point of writing one, and what the pins hold and a new agent adopts afterwards.

use std::{
    collections::VecDeque,
    fmt::Write as _,
    fs,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use crate::{agent_table, bed, replace_file, status, wait_for_every, Bed, Scratch};
use ratelimit::{
    compile::{compile, RuleIds},
    config::Config,
    maps::PinnedMaps,
};
use ratelimit_testbed::AgentProcess;
use serde_json::Value;

/// Entries of each deny list: enough that writing a rule set takes a while (the window to kill
/// the agent in), few enough that the test's agents start quickly.
pub(crate) const LIST_LEN: u32 = 50_000;

/// Two deny lists of [`LIST_LEN`] /32s each (disjoint), plus one test source each, and one
/// changed limit rule, so that a reload rewrites prefixes, a rule record and the rule names.
pub(crate) struct Sets {
    /// The config text of set 0 and set 1; set `k` denies `SOURCES[k]`.
    pub(crate) configs: [String; 2],
}

pub(crate) const SOURCES: [&str; 2] = ["198.18.0.101", "198.18.0.102"];

pub(crate) fn write_sets(dir: &Scratch, iface: &str, pin: &Path, socket: &Path) -> Sets {
    let mut configs = Vec::new();
    for (k, source) in SOURCES.iter().enumerate() {
        let mut list = String::new();
        for i in 0..LIST_LEN {
            let a = 0xC613_0000u32 + i * 2 + u32::try_from(k).unwrap(); // 198.19.x.y, even or odd
            let _ = writeln!(
                list,
                "{}.{}.{}.{}",
                a >> 24,
                (a >> 16) & 255,
                (a >> 8) & 255,
                a & 255
            );
        }
        let _ = writeln!(list, "{source}");
        let list_path = dir.path(&format!("deny-{k}.txt"));
        fs::write(&list_path, list).unwrap();
        configs.push(format!(
            "{}[[rule]]\nname = \"blocklist\"\nsource_file = \"{}\"\naction = \"deny\"\n\n\
             [[rule]]\nname = \"other\"\nsource = \"198.18.1.0/24\"\nrate = {}\nburst = 10\n",
            agent_table(iface, pin, socket),
            list_path.display(),
            100 + k
        ));
    }
    Sets {
        configs: configs.try_into().unwrap(),
    }
}

/// A prefix entry as compared: address, LPM length, and the (name, record) of each candidate.
pub(crate) type Entry = (Vec<u8>, u32, Vec<(String, ratelimit_common::Rule)>);

/// What the pinned maps hold: `Some(k)` when the active generation's prefixes and the rules they
/// name are exactly set `k`'s (`None`: a mix, or neither), the same for the inactive generation
/// (between reloads it mirrors the active one; an install cut short leaves it a mix), and how
/// many entries the inactive generation holds.
pub(crate) fn pinned_state(pin: &Path, sets: &Sets) -> (Option<usize>, Option<usize>, usize) {
    let maps = PinnedMaps::open(pin).unwrap();
    let generation = ratelimit_common::prefix_generation(maps.config().unwrap().generation);
    let active = generation_state(&maps, sets, generation);
    let inactive = generation_state(&maps, sets, 1 - generation);
    (active.0, inactive.0, inactive.1)
}

/// Which set generation `generation` of the pinned prefix trie holds exactly, and its entries.
pub(crate) fn generation_state(
    maps: &PinnedMaps,
    sets: &Sets,
    generation: u8,
) -> (Option<usize>, usize) {
    let named = maps.named_rules().unwrap();
    let mut active = Vec::<Entry>::new();
    for (key, len, set) in maps.prefixes().unwrap() {
        if key.generation != generation {
            continue;
        }
        let rules = set.rules[..set.len as usize]
            .iter()
            .map(|id| {
                // The bucket generation is the data plane's (compiled records carry none).
                named.get(id).map_or(
                    (format!("unnamed id {id}"), Default::default()),
                    |(n, _, r)| {
                        (
                            n.clone(),
                            ratelimit_common::Rule {
                                bucket_gen: 0,
                                ..*r
                            },
                        )
                    },
                )
            })
            .collect();
        active.push((key.addr.to_vec(), len, rules));
    }
    active.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    let k = sets.configs.iter().position(|text| {
        let config = Config::parse(text, "sets.toml").unwrap();
        let compiled = compile(&config.rules, &RuleIds::new()).unwrap();
        let mut want: Vec<Entry> = compiled
            .prefixes
            .iter()
            .map(|p| {
                let rules = p
                    .candidates()
                    .iter()
                    .map(|&id| {
                        let r = compiled.rule(id).unwrap();
                        (r.name.clone(), r.rule)
                    })
                    .collect();
                (p.addr.to_vec(), p.lpm_prefix_len(), rules)
            })
            .collect();
        want.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        want == active
    });
    (k, active.len())
}

/// Starts an agent on `config` and checks that it adopted the pinned state cleanly and put its
/// own set `k` in force.
pub(crate) fn adopting_agent(
    bed: &Bed,
    config: &str,
    pin: &Path,
    sets: &Sets,
    k: usize,
) -> AgentProcess {
    let agent = AgentProcess::start(&bed.rx, config, &[]).unwrap();
    let log = agent.log();
    assert!(
        log.contains("adopted=true") && !log.contains("unusable"),
        "unclean adoption:\n{log}"
    );
    let s = status(&agent);
    assert_eq!(
        (s["rules"].as_u64(), s["reloads"]["failed"].as_u64()),
        (Some(2), Some(0)),
        "{s}"
    );
    let (active, mirror, _) = pinned_state(pin, sets);
    assert_eq!((active, mirror), (Some(k), Some(k)), "after adoption");
    let (a, b) = (bed.delivered(SOURCES[0]), bed.delivered(SOURCES[1]));
    assert_eq!(
        (a == 0, b == 0),
        (k == 0, k == 1),
        "after adoption of set {k}: A got {a}, B got {b} through"
    );
    agent
}

/// Where in a reload a kill lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Point {
    /// The new set partly written into the inactive generation.
    Writing,
    /// The switch made (the epoch moved), the old generation maybe not yet retired.
    Switched,
    /// The reload finished (counted by the agent).
    Done,
}

/// What a [`Probe`] sees.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// None of the sampled entries of the new set in the inactive generation.
    Before,
    /// Some of them, not all.
    Writing,
    /// All of them.
    Written,
    /// The epoch moved.
    Switched,
}

/// Watches a reload to set `target` in the pinned maps with single lookups: the epoch, and 16
/// of the new set's list entries, spread over it, in the generation being written.
pub(crate) struct Probe {
    pub(crate) maps: PinnedMaps,
    pub(crate) trie: aya::maps::LpmTrie<
        aya::maps::MapData,
        ratelimit_common::PrefixKey,
        ratelimit_common::RuleSet,
    >,
    pub(crate) epoch: u32,
    pub(crate) keys: Vec<aya::maps::lpm_trie::Key<ratelimit_common::PrefixKey>>,
}

impl Probe {
    pub(crate) fn new(pin: &Path, epoch: u32, target: usize) -> Probe {
        let data =
            aya::maps::MapData::from_pin(pin.join(ratelimit_common::map_names::PREFIXES)).unwrap();
        let trie = aya::maps::LpmTrie::try_from(aya::maps::Map::LpmTrie(data)).unwrap();
        let next = ratelimit_common::prefix_generation(epoch.wrapping_add(1));
        let keys = (0..16u32)
            .map(|n| {
                let i = n * (LIST_LEN - 1) / 15;
                let addr = 0xC613_0000u32 + i * 2 + u32::try_from(target).unwrap();
                let mut bytes = [0u8; 16];
                bytes[..4].copy_from_slice(&addr.to_be_bytes());
                aya::maps::lpm_trie::Key::new(
                    ratelimit_common::PREFIX_KEY_HEADER_BITS + 32,
                    ratelimit_common::PrefixKey {
                        generation: next,
                        family: ratelimit_common::family::V4,
                        addr: bytes,
                    },
                )
            })
            .collect();
        Probe {
            maps: PinnedMaps::open(pin).unwrap(),
            trie,
            epoch,
            keys,
        }
    }

    pub(crate) fn look(&self) -> Seen {
        if self.maps.config().unwrap().generation != self.epoch {
            return Seen::Switched;
        }
        let present = self
            .keys
            .iter()
            .filter(|k| self.trie.get(k, 0).is_ok())
            .count();
        match present {
            0 => Seen::Before,
            n if n == self.keys.len() => Seen::Written,
            _ => Seen::Writing,
        }
    }
}

#[test]
fn killed_in_the_middle_of_a_reload_leaves_one_whole_rule_set_that_a_new_agent_adopts() {
    let bed = bed("kil");
    let tmp = Scratch::new("kill");
    let (pin, socket) = (AgentProcess::unique_pin_path(), tmp.path("agent.sock"));
    let sets = write_sets(&tmp, &bed.rx_if, &pin, &socket);
    let mut agent = AgentProcess::start(&bed.rx, &sets.configs[0], &[]).unwrap();

    // How long one reload takes here, from the config change (the agent polls the file every
    // 250 ms) until it is done: status answers once the reload lets go of the agent.
    let t0 = Instant::now();
    replace_file(agent.config_path(), &sets.configs[1]);
    let mut last = Value::Null;
    let deadline = Instant::now() + Duration::from_secs(60);
    while last["reloads"]["ok"] != 1 {
        assert!(
            Instant::now() < deadline,
            "timed out after 60 s waiting for the first reload; last status {last}\nagent log:\n{}",
            agent.log()
        );
        thread::sleep(Duration::from_millis(100));
        last = status(&agent);
    }
    let full = t0.elapsed();
    let (active, mirror, _) = pinned_state(&pin, &sets);
    assert_eq!(
        (active, mirror),
        (Some(1), Some(1)),
        "both generations hold the set in force"
    );
    println!("a reload of {LIST_LEN} prefixes takes {full:?} from the file change");

    // Kill at exact points of a reload, each observed in the pinned maps (no sleep: a kill that
    // missed its point is seen and named): while the new set is being written into the inactive
    // generation (some of its entries there, some not yet), right after the switch (the rule
    // set's epoch moved; the old generation not yet retired), and after the reload is done.
    // A kill meant for the writing that came too late (the reload outran the polls) still tests
    // a kill and is kept, but the writing point is then tried again, up to `RETRIES` more times:
    // the recovery from a half-written generation must have run at least once.
    const RETRIES: usize = 4;
    let mut current = 1;
    let mut kept = Vec::new();
    let mut outcomes = Vec::new();
    let mut points = VecDeque::from([Point::Writing, Point::Switched, Point::Writing, Point::Done]);
    let mut retries = 0;
    while let Some(point) = points.pop_front() {
        let target = 1 - current;
        let epoch = PinnedMaps::open(&pin).unwrap().config().unwrap().generation;
        let ok_before = status(&agent)["reloads"]["ok"].as_u64().unwrap();
        let probe = Probe::new(&pin, epoch, target);
        replace_file(agent.config_path(), &sets.configs[target]);
        // The pinned maps polled every millisecond (the writing lasts tens of ms here;
        // `wait_for`'s 100 ms polls missed it twice in one run); the agent's status (a CLI run
        // each) every 100 ms.
        let period = Duration::from_millis(if point == Point::Done { 100 } else { 1 });
        let reached = wait_for_every(
            Duration::from_secs(60),
            period,
            "the reload to reach its point",
            || {
                let seen = probe.look();
                let reached = match point {
                    Point::Writing => seen == Seen::Writing,
                    Point::Switched => seen == Seen::Switched,
                    Point::Done => status(&agent)["reloads"]["ok"].as_u64() == Some(ok_before + 1),
                };
                // Past the point (a reload quicker than the polls): kill anyway and say so.
                (reached || (point == Point::Writing && seen == Seen::Switched)).then_some(reached)
            },
        );
        agent.crash().unwrap();
        let (_, pins) = agent.stop_keeping_pins().unwrap();
        kept.push(pins);

        // The pinned state, and what real packets see: the link stays attached without an agent.
        let (in_force, inactive, leftover) = pinned_state(&pin, &sets);
        let (a, b) = (bed.delivered(SOURCES[0]), bed.delivered(SOURCES[1]));
        println!(
            "killed at {point:?} (reached: {reached}) of a reload from set {current} to set \
             {target}: set in force {in_force:?}, the inactive generation holds {inactive:?} \
             ({leftover} entries); \
             A got {a}, B got {b} through"
        );
        let k = in_force
            .unwrap_or_else(|| panic!("killed at {point:?}: the pinned rules are neither set"));
        assert!(bed.xdp().is_some(), "detached by the kill");
        assert_eq!(
            (a == 0, b == 0),
            (k == 0, k == 1),
            "packets disagree with the pinned set {k}"
        );
        if reached {
            // Before the switch the old set is whole in force, the new one half written; after
            // it, the new set is.
            let want = if point == Point::Writing {
                current
            } else {
                target
            };
            assert_eq!(k, want, "killed at {point:?}");
            if point == Point::Writing {
                assert_eq!(
                    inactive, None,
                    "killed while writing, but the inactive generation holds one whole set"
                );
            }
            if point == Point::Done {
                assert_eq!(
                    inactive,
                    Some(target),
                    "a finished reload left its old generation behind the new set"
                );
            }
        }
        outcomes.push((point, reached, k == target, inactive));
        let wrote = |o: &(Point, bool, bool, Option<usize>)| o.0 == Point::Writing && o.1;
        if point == Point::Writing && !reached && !outcomes.iter().any(wrote) && retries < RETRIES {
            retries += 1;
            points.push_back(Point::Writing);
        }

        // A new agent adopts it and applies its own config, the set in force: it writes it into
        // the inactive generation, which holds what the kill interrupted (the other set, half
        // written or half retired), so that must be cleared first or the set after the swap is
        // a mix of both.
        current = k;
        agent = adopting_agent(&bed, &sets.configs[current], &pin, &sets, current);
    }
    println!("(point, reached, new set in force, set the inactive generation holds): {outcomes:?}");
    assert!(
        outcomes
            .iter()
            .any(|o| o.0 == Point::Writing && o.1 && o.3.is_none()),
        "no kill landed while the new set was being written: the recovery from a half-written \
         generation never ran: {outcomes:?}"
    );

    agent.stop().unwrap();
    assert!(!pin.exists());
    drop(kept);
}
