//! The learned histories on disk: `<state_dir>/learned.json`, written atomically (a temporary
//! file in the same directory, synced, then renamed over the old one) and versioned. A file
//! that cannot be read back whole (not JSON, an unknown version, a sketch that does not decode
//! or is not of this accuracy, out-of-range fields) is refused as a whole: the agent logs why,
//! naming the file, and starts with no history.
//!
//! Version 2 adds to each slot its heaviest buckets (`heavy`: source, peaks, burst). A version 1
//! file, written by an agent before them, is read as the history it holds, its slots naming no
//! bucket: an upgrade keeps what was learned, and the lists fill from the next observations.

use std::{
    collections::BTreeMap,
    fs,
    io::{Read as _, Write as _},
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use sketches_ddsketch::DDSketch;

use super::{
    heavy::{Heavy, Source, Top, HEAVY_K, RANGE},
    history::{sketch, Dist, History, Slot, DAY_SECS, HOUR_SECS, SLOT_SECS},
};

/// The file's format version.
pub const VERSION: u32 = 2;
/// The oldest version read back (1: no heaviest buckets).
pub const OLDEST: u32 = 1;
/// The file's name in the state directory.
pub const FILE: &str = "learned.json";
/// Largest file read back (a full history of every learned limit is far smaller).
const MAX_BYTES: u64 = 64 << 20;
/// Largest observation count a sketch may claim.
const MAX_COUNT: u64 = 1 << 48;

/// Histories by (rule name, limit number from 1).
pub type Histories = BTreeMap<(String, usize), History>;

#[derive(Serialize, Deserialize)]
struct FileV2 {
    version: u32,
    saved_unix: u64,
    limits: Vec<LimitV2>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitV2 {
    rule: String,
    limit: usize,
    slots: Vec<SlotV2>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SlotV2 {
    start: u64,
    /// [`SLOT_SECS`] or [`HOUR_SECS`].
    len: u64,
    /// The three sketches, each in DDSketch's binary encoding, in hex.
    peak_1s: String,
    peak_10s: String,
    burst: String,
    /// The heaviest buckets, heaviest first (absent in version 1).
    #[serde(default)]
    heavy: Vec<HeavyV2>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeavyV2 {
    /// As `top` shows it: `198.18.0.7/32`, `198.18.0.0/24`, `*`.
    source: String,
    peak_1s: f64,
    peak_10s: f64,
    burst: f64,
}

/// A slot's list read back, if it is no longer than a list holds and its sources and figures
/// are in range.
fn read_heavy(rule: &str, heavy: Vec<HeavyV2>) -> Result<Top, String> {
    if heavy.len() > HEAVY_K {
        return Err(format!(
            "rule {rule:?}: a slot names {} buckets (at most {HEAVY_K})",
            heavy.len()
        ));
    }
    let mut top = Top::default();
    for h in heavy {
        let source: Source = h.source.parse()?;
        let figures = [h.peak_1s, h.peak_10s, h.burst];
        if !figures.iter().all(|v| (0.0..=RANGE.1).contains(v)) {
            return Err(format!("rule {rule:?}: {source}'s figures {figures:?}"));
        }
        top.add(Heavy {
            source,
            peak_1s: h.peak_1s,
            peak_10s: h.peak_10s,
            burst: h.burst,
        });
    }
    Ok(top)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A sketch read back, if it decodes and is of this accuracy with sane summary values.
fn read_sketch(s: &str) -> Result<DDSketch, String> {
    let bytes = unhex(s).ok_or("a sketch is not hex")?;
    let d = DDSketch::from_java_bytes(&bytes).map_err(|e| format!("a sketch: {e:?}"))?;
    let mut ours = sketch();
    ours.merge(&d)
        .map_err(|_| "a sketch of another accuracy".to_owned())?;
    let count = ours.count() as u64;
    if count > MAX_COUNT {
        return Err(format!("a sketch claims {count} observations"));
    }
    if count > 0 {
        let (min, max) = (ours.min().unwrap_or(0.0), ours.max().unwrap_or(0.0));
        if !(min.is_finite() && max.is_finite() && min >= 0.0 && min <= max) {
            return Err(format!("a sketch's range {min}..{max}"));
        }
    }
    Ok(ours)
}

/// The histories as the file holds them, at `now` (Unix seconds).
#[must_use]
pub fn encode(histories: &Histories, now: u64) -> Vec<u8> {
    let slot = |s: &Slot, len: u64| SlotV2 {
        start: s.start,
        len,
        peak_1s: hex(&s.dist.peak_1s.to_java_bytes()),
        peak_10s: hex(&s.dist.peak_10s.to_java_bytes()),
        burst: hex(&s.dist.burst.to_java_bytes()),
        heavy: s
            .dist
            .heavy
            .entries()
            .iter()
            .map(|h| HeavyV2 {
                source: h.source.to_string(),
                peak_1s: h.peak_1s,
                peak_10s: h.peak_10s,
                burst: h.burst,
            })
            .collect(),
    };
    let limits = histories
        .iter()
        .filter(|(_, h)| !h.is_empty())
        .map(|((rule, limit), h)| LimitV2 {
            rule: rule.clone(),
            limit: *limit,
            slots: h
                .hours
                .iter()
                .map(|s| slot(s, HOUR_SECS))
                .chain(
                    h.recent
                        .iter()
                        .chain(h.current.iter())
                        .map(|s| slot(s, SLOT_SECS)),
                )
                .collect(),
        })
        .collect();
    serde_json::to_vec(&FileV2 {
        version: VERSION,
        saved_unix: now,
        limits,
    })
    .unwrap_or_default()
}

/// Reads the histories back from `bytes` at `now` (Unix seconds), dropping what is older than a
/// day; `Err` says why the whole file is refused.
pub fn decode(bytes: &[u8], now: u64, max_limits: usize) -> Result<Histories, String> {
    #[derive(Deserialize)]
    struct Version {
        version: u32,
    }
    let v: Version =
        serde_json::from_slice(bytes).map_err(|e| format!("not a learned-state file: {e}"))?;
    if !(OLDEST..=VERSION).contains(&v.version) {
        return Err(format!(
            "version {} (this agent reads versions {OLDEST} to {VERSION})",
            v.version
        ));
    }
    let file: FileV2 = serde_json::from_slice(bytes).map_err(|e| format!("malformed: {e}"))?;
    if file.limits.len() > max_limits {
        return Err(format!(
            "{} limits (at most {max_limits})",
            file.limits.len()
        ));
    }
    let mut out = Histories::new();
    for l in file.limits {
        if l.rule.is_empty() || l.rule.len() > 64 || !(1..=4).contains(&l.limit) {
            return Err(format!("a limit {:?}/{} out of range", l.rule, l.limit));
        }
        if l.slots.len() > 64 {
            return Err(format!("rule {:?}: {} slots", l.rule, l.slots.len()));
        }
        let mut h = History::default();
        let mut last = 0;
        for s in l.slots {
            if !(s.len == SLOT_SECS || s.len == HOUR_SECS) || s.start % s.len != 0 {
                return Err(format!(
                    "rule {:?}: a slot at {} of {} s",
                    l.rule, s.start, s.len
                ));
            }
            if s.start < last || s.start > now.saturating_add(SLOT_SECS) {
                return Err(format!("rule {:?}: slots out of order", l.rule));
            }
            last = s.start;
            let dist = Dist {
                peak_1s: read_sketch(&s.peak_1s)?,
                peak_10s: read_sketch(&s.peak_10s)?,
                burst: read_sketch(&s.burst)?,
                heavy: read_heavy(&l.rule, s.heavy)?,
            };
            if s.start + s.len + DAY_SECS <= now {
                continue;
            }
            let slot = Slot {
                start: s.start,
                dist,
            };
            if s.len == HOUR_SECS {
                h.hours.push_back(slot);
            } else {
                h.recent.push_back(slot);
            }
        }
        // The slot being filled at the save is filled on; `roll` sorts the rest.
        if h.recent.back().is_some_and(|s| s.start + SLOT_SECS > now) {
            h.current = h.recent.pop_back();
        }
        h.roll(now);
        out.insert((l.rule, l.limit), h);
    }
    Ok(out)
}

/// The state file in `dir`.
#[must_use]
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Writes `bytes` as `dir`/[`FILE`] atomically: a temporary file beside it, synced, renamed over
/// it, the directory synced. `dir` is created (mode 0700) if missing. A crash leaves the old file
/// or the new one whole, never a part.
pub fn write_atomic(dir: &Path, bytes: &[u8]) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let target = path(dir);
    let tmp = dir.join(format!(".{FILE}.tmp"));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    fs::rename(&tmp, &target)?;
    fs::File::open(dir)?.sync_all()
}

/// Reads `dir`/[`FILE`] at `now`: `Ok(None)` if there is none, `Err` (with the reason, to log
/// with the path) if it is refused.
pub fn read(dir: &Path, now: u64, max_limits: usize) -> Result<Option<Histories>, String> {
    let p = path(dir);
    let f = match fs::File::open(&p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let mut bytes = Vec::new();
    f.take(MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(format!("larger than {MAX_BYTES} bytes"));
    }
    decode(&bytes, now, max_limits).map(Some)
}
