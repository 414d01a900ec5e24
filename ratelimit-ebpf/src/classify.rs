//! Classification: the rule a packet falls under.
//!
//! One LPM lookup on the source address (under the active generation) yields the candidate rules
//! for the longest matching prefix, already ordered by the agent (see `RuleSet`); the first whose
//! protocol and destination port match wins.

use aya_ebpf::maps::lpm_trie::Key;
use ratelimit_common::{family, PrefixKey, Rule, MAX_CANDIDATES, PREFIX_KEY_HEADER_BITS};

use crate::{
    maps::{PREFIXES, RULES},
    parse::Packet,
};

#[inline(always)]
pub fn classify(pkt: &Packet, generation: u32) -> Option<(u32, &'static Rule)> {
    let bits = if pkt.family == family::V4 { 32 } else { 128 };
    // SAFETY: [u32; 4] and [u8; 16] have the same size and any bit pattern is valid for both.
    let addr: [u8; 16] = unsafe { core::mem::transmute(pkt.src) };
    let key = Key::new(
        PREFIX_KEY_HEADER_BITS + bits,
        PrefixKey {
            generation: generation as u8,
            family: pkt.family,
            addr,
        },
    );
    let set = PREFIXES.get(&key)?;
    let len = set.len as usize;
    for i in 0..MAX_CANDIDATES {
        if i >= len {
            break;
        }
        let id = set.rules[i];
        let Some(rule) = RULES.get(id) else { continue };
        if rule.protocol != 0 && rule.protocol != pkt.protocol {
            continue;
        }
        if rule.dst_port != 0 && pkt.dst_port != rule.dst_port {
            continue;
        }
        return Some((id, rule));
    }
    None
}
