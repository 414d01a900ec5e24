//! What the Redis store answers under `[cluster] backend = "redis"`: a holder's field of a key
//! (`NODE_ID` -> `MS:GENERATION:DEMAND`), which anyone able to write to the store can set to any
//! bytes, read by `cluster::redis::parse_field`. Besides "no panic, no overflow": a field read
//! has a node id of 1 to 128 bytes without control characters, a demand that is finite, not
//! negative and at most `MAX_DEMAND`, and an age no later than the server's time allows.
//!
//! The input is the node id and the value, split at its first 0 byte (all of it the value when
//! there is none), and the server's time from its last 8 bytes when it has them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ratelimit::cluster::redis::{parse_field, MAX_DEMAND};

fuzz_target!(|data: &[u8]| {
    let (now, data) = match data.len().checked_sub(8) {
        Some(at) => (
            u64::from_le_bytes(data[at..].try_into().expect("8 bytes")),
            &data[..at],
        ),
        None => (0, data),
    };
    let (node, value) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (&b"h/198.18.1.2"[..], data),
    };
    if let Some(f) = parse_field(node, value, now) {
        assert!(
            f.demand.is_finite() && (0.0..=MAX_DEMAND).contains(&f.demand),
            "{f:?}"
        );
        assert!(!f.node.is_empty() && f.node.len() <= 128, "{f:?}");
        assert!(!f.node.chars().any(char::is_control), "{f:?}");
        assert!(f.age_ms <= now, "{f:?}");
    }
});
