//! The settings spelled as words in the config file (`mode`, `action`, `protocol`, `tcp_flags`,
//! `scope`, `per`): their enums and their one spelling, for parsing, display and JSON alike.
//! Its own room because every table uses them and the spellings must not drift apart.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// XDP attach mode (`[agent] mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachMode {
    /// Native (driver) mode if the driver supports it, else generic (skb) mode.
    #[default]
    Auto,
    /// Driver mode only; attaching fails if unsupported.
    Native,
    /// Generic mode (works everywhere, slower).
    Skb,
}

/// What a rule does with the packets it matches (`action`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Token-bucket limit.
    #[default]
    Limit,
    /// Always pass.
    Allow,
    /// Always drop.
    Deny,
}

/// The L4 protocol a rule matches (`protocol`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP (6).
    Tcp,
    /// UDP (17).
    Udp,
    /// ICMP (1) for an IPv4 rule, ICMPv6 (58) for an IPv6 rule.
    Icmp,
    /// Any protocol.
    #[default]
    Any,
}

/// The TCP flag set a `protocol = "tcp"` rule matches (`tcp_flags`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TcpFlags {
    /// SYN set and ACK clear: a connection attempt (not the server's SYN-ACK).
    #[default]
    Syn,
}

impl TcpFlags {
    /// The flag bits the set looks at and the values they must have, as the XDP program
    /// compares them (`flags & mask == value`; see `ratelimit_common::tcp_flags`).
    pub const fn mask_value(self) -> (u8, u8) {
        use ratelimit_common::tcp_flags::{ACK, SYN};
        match self {
            Self::Syn => (SYN | ACK, SYN),
        }
    }

    /// In words, for `explain`.
    pub const fn describe(self) -> &'static str {
        match self {
            Self::Syn => "SYN set, ACK clear",
        }
    }
}

/// Whose consumption a limit rule's budget counts (`scope`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// This host only.
    #[default]
    Local,
    /// Shared with the cluster's peers.
    Cluster,
}

/// Bucket granularity of a limit rule (`per`): which sources share one bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Per {
    /// One bucket per source address (`"source"`).
    #[default]
    Source,
    /// One bucket for the whole rule (`"rule"`).
    Rule,
    /// One bucket per source prefix of this length (`"/24"`).
    Prefix(u8),
}

macro_rules! keyword_enum {
    ($ty:ty, $what:literal, $($variant:ident => $text:literal),+) => {
        impl $ty {
            /// The spelling used in the config file.
            pub const fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    _ => Err(format!(
                        concat!("unknown ", $what, " {:?}, expected one of: ", $($text, " "),+),
                        s
                    )),
                }
            }
        }
    };
}
keyword_enum!(AttachMode, "mode", Auto => "auto", Native => "native", Skb => "skb");
keyword_enum!(Action, "action", Limit => "limit", Allow => "allow", Deny => "deny");
keyword_enum!(Protocol, "protocol", Tcp => "tcp", Udp => "udp", Icmp => "icmp", Any => "any");
keyword_enum!(Scope, "scope", Local => "local", Cluster => "cluster");
keyword_enum!(TcpFlags, "tcp_flags", Syn => "syn");

impl fmt::Display for Per {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Per::Source => f.write_str("source"),
            Per::Rule => f.write_str("rule"),
            Per::Prefix(len) => write!(f, "/{len}"),
        }
    }
}

impl FromStr for Per {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("{s:?} is not \"source\", \"rule\" or a prefix length such as \"/24\"");
        match s {
            "source" => Ok(Per::Source),
            "rule" => Ok(Per::Rule),
            _ => {
                let digits = s.strip_prefix('/').ok_or_else(bad)?;
                // Only plain decimal digits: u8::from_str would accept "+24".
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                match digits.parse::<u8>() {
                    Ok(len) if len <= 128 => Ok(Per::Prefix(len)),
                    _ => Err(format!(
                        "prefix length in {s:?} must be 0..=32 (IPv4) or 0..=128 (IPv6)"
                    )),
                }
            }
        }
    }
}

impl Serialize for Per {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Per {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
