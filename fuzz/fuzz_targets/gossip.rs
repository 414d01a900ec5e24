//! What cluster peers send (`cluster::wire::Codec::open`, and the consumption keys and values of
//! `cluster::publish`): any datagram is opened or dropped, never a panic; a sealed message opens
//! to itself once, in any order of its parts, and not twice (replay), tampered with, at another
//! host or from another source address.
#![no_main]

use std::net::SocketAddr;

use libfuzzer_sys::fuzz_target;
use ratelimit::cluster::{
    key::ClusterKey,
    publish::{Count, KeyName},
    wire::{Codec, Reject, MAX_MESSAGE},
};

const SECRET: &[u8] = b"a fuzzing secret, long enough for the key file\n";
const NOW_MS: u64 = 1_800_000_000_000;

fuzz_target!(|data: &[u8]| {
    let key = ClusterKey::from_secret(SECRET, "fuzz").expect("long enough");
    let from: SocketAddr = "192.0.2.1:7946".parse().expect("address");
    let to: SocketAddr = "192.0.2.2:7946".parse().expect("address");
    let other: SocketAddr = "192.0.2.3:7946".parse().expect("address");

    // 1. Anything off the network.
    let mut receiver = Codec::new(&key, "fuzz", to);
    let _ = receiver.open(data, from, NOW_MS);

    // 2. Keys and values of the consumption gossip.
    if let Ok(text) = std::str::from_utf8(data) {
        if let Some(k) = KeyName::parse(text) {
            assert_eq!(KeyName::parse(&k.to_key()).as_ref(), Some(&k), "{text:?}");
        }
        if let Some(c) = Count::parse(text) {
            assert_eq!(Count::parse(&c.to_value()), Some(c), "{text:?}");
        }
    }

    // 3. Seal and open. `0xff, hi, lo, ...` makes a message of (hi, lo) * 4 bytes (up to
    //    MAX_MESSAGE), so that messages of several parts are reached.
    let message: Vec<u8> = match data {
        [0xff, hi, lo, rest @ ..] if !rest.is_empty() => {
            let len = (usize::from(u16::from_be_bytes([*hi, *lo])) * 4).min(MAX_MESSAGE);
            rest.iter().copied().cycle().take(len).collect()
        }
        _ => data.to_vec(),
    };
    let mut sender = Codec::new(&key, "fuzz", from);
    let parts = sender
        .seal(&message, to, NOW_MS)
        .expect("within MAX_MESSAGE");
    // Replayed to another host, or spoofed from another address: refused, remembering nothing.
    let mut elsewhere = Codec::new(&key, "fuzz", other);
    let mut receiver = Codec::new(&key, "fuzz", to);
    for part in &parts {
        assert_eq!(
            elsewhere.open(part, from, NOW_MS + 1),
            Err(Reject::Auth),
            "opened at another host"
        );
        assert_eq!(
            receiver.open(part, other, NOW_MS + 1),
            Err(Reject::Auth),
            "opened from another source"
        );
    }
    // Parts in an order chosen by the input.
    let mut order: Vec<usize> = (0..parts.len()).collect();
    let spin = data.first().copied().map_or(0, usize::from);
    order.rotate_left(spin % parts.len());
    if spin & 0x80 != 0 {
        order.reverse();
    }
    let mut opened = None;
    for (n, &i) in order.iter().enumerate() {
        let got = receiver
            .open(&parts[i], from, NOW_MS + 1)
            .expect("a sealed part opens");
        if n + 1 < order.len() {
            assert!(
                got.is_none(),
                "message complete after {} of {} parts",
                n + 1,
                parts.len()
            );
        } else {
            opened = got;
        }
    }
    assert!(
        opened.as_deref() == Some(&message[..]),
        "message changed in transit"
    );
    assert_eq!(
        receiver.open(&parts[0], from, NOW_MS + 2),
        Err(Reject::Stale),
        "replay accepted"
    );
    // Any flipped bit is caught.
    let mut tampered = parts[order[0]].clone();
    let at = usize::from(data.get(1).copied().unwrap_or(0)) * 257 % tampered.len();
    tampered[at] ^= 1 << (data.get(2).copied().unwrap_or(0) % 8);
    let mut fresh = Codec::new(&key, "fuzz", to);
    assert!(
        fresh.open(&tampered, from, NOW_MS).is_err(),
        "a datagram with byte {at} flipped was accepted"
    );
});
