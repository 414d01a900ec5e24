//! The checks of one rule ([`RuleConfig::validate`]) that rules from a file and from the control
//! API both go through, and [`RuleError`], the key at fault and why. Its own room because the
//! parser, the list reader and the API all lean on these checks and their messages.

use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv6Net};

use super::{
    model::NS_PER_SEC, Action, LimitConfig, Per, Protocol, RuleConfig, Scope, MAX_BYTES_RATE,
    MAX_EXTRA_LIMITS, MAX_NAME_LEN, MAX_RATE, MAX_RULE_PREFIXES, MAX_TOLERANCE_NS, MIN_BYTES_BURST,
};

/// Why a [`RuleConfig`] is invalid: the key at fault and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("field `{field}`: {message}")]
pub struct RuleError {
    /// The config key at fault.
    pub field: &'static str,
    /// What is wrong, for a human.
    pub message: String,
}

pub(super) fn rule_error(field: &'static str, message: impl Into<String>) -> RuleError {
    RuleError {
        field,
        message: message.into(),
    }
}

impl LimitConfig {
    /// Checks the limit alone, for a rule whose sources are of families `(v4, v6)`. The error
    /// names the limit's own key (`rate`, `per`...).
    pub fn validate(&self, families: (bool, bool)) -> Result<(), RuleError> {
        check_rates(
            (self.rate, self.burst),
            (self.bytes_rate, self.bytes_burst),
            "a limit",
        )?;
        check_per(self.per, families)
    }
}

/// Checks `per = "/N"` against the rule's source families.
fn check_per(per: Per, families: (bool, bool)) -> Result<(), RuleError> {
    if let Per::Prefix(len) = per {
        let (width, family) = match families {
            (true, true) => {
                return Err(rule_error(
                    "per",
                    format!(
                        "\"/{len}\" groups sources by a prefix length of one address family, \
                         but this rule's sources mix IPv4 and IPv6 prefixes; use per = \"source\" \
                         or \"rule\", or split the rule into one rule per family"
                    ),
                ))
            }
            (false, true) => (128, "IPv6"),
            _ => (32, "IPv4"),
        };
        if len > width {
            return Err(rule_error(
                "per",
                format!("/{len} is longer than an {family} address (at most /{width})"),
            ));
        }
    }
    Ok(())
}

impl RuleConfig {
    /// Checks everything that can be checked on one rule alone (not uniqueness across rules).
    ///
    /// Defaults are not filled in here: `burst` and `bytes_burst` must already be set when
    /// `rate` and `bytes_rate` are (the config parser does that).
    pub fn validate(&self) -> Result<(), RuleError> {
        validate_name(&self.name).map_err(|m| rule_error("name", m))?;
        self.validate_sources()?;
        if let Some(port) = self.dst_port {
            if port == 0 {
                return Err(rule_error("dst_port", "must be between 1 and 65535"));
            }
            if !matches!(self.protocol, Protocol::Tcp | Protocol::Udp) {
                return Err(rule_error(
                    "dst_port",
                    format!(
                        "only valid with protocol tcp or udp (this rule has protocol {})",
                        self.protocol
                    ),
                ));
            }
        }
        if self.tcp_flags.is_some() && self.protocol != Protocol::Tcp {
            return Err(rule_error(
                "tcp_flags",
                format!(
                    "only valid with protocol tcp (this rule has protocol {})",
                    self.protocol
                ),
            ));
        }
        if self.action != Action::Limit {
            let stray = [
                ("rate", self.rate.is_some()),
                ("burst", self.burst.is_some()),
                ("bytes_rate", self.bytes_rate.is_some()),
                ("bytes_burst", self.bytes_burst.is_some()),
                ("per", self.per != Per::Source),
                ("scope", self.scope != Scope::Local),
                ("limit", !self.limits.is_empty()),
            ];
            if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
                return Err(no_meaning(field, self.action));
            }
            return Ok(());
        }
        check_rates(
            (self.rate, self.burst),
            (self.bytes_rate, self.bytes_burst),
            "a limit rule",
        )?;
        check_per(self.per, self.families())?;
        if self.limits.len() > MAX_EXTRA_LIMITS {
            return Err(rule_error(
                "limit",
                format!(
                    "{} `[[rule.limit]]` tables; a rule may have at most {} limits, its own and \
                     {MAX_EXTRA_LIMITS} more",
                    self.limits.len(),
                    MAX_EXTRA_LIMITS + 1
                ),
            ));
        }
        for (i, l) in self.limits.iter().enumerate() {
            l.validate(self.families()).map_err(|e| {
                rule_error(
                    "limit",
                    format!(
                        "limit {} ([[rule.limit]] #{}{}): `{}` {}",
                        i + 2,
                        i + 1,
                        if l.line > 0 {
                            format!(", line {}", l.line)
                        } else {
                            String::new()
                        },
                        e.field,
                        e.message
                    ),
                )
            })?;
        }
        Ok(())
    }

    /// The checks on `sources` (and `protocol = "icmp"`, which depends on their family).
    fn validate_sources(&self) -> Result<(), RuleError> {
        let key = if self.source_file.is_some() {
            "source_file"
        } else {
            "source"
        };
        if self.sources.is_empty() && self.source_file.is_none() {
            return Err(rule_error(key, "must list at least one prefix"));
        }
        if self.sources.len() > MAX_RULE_PREFIXES {
            return Err(rule_error(
                key,
                format!(
                    "lists {} prefixes; one rule may list at most {MAX_RULE_PREFIXES}",
                    self.sources.len()
                ),
            ));
        }
        for net in &self.sources {
            validate_source(net).map_err(|m| rule_error(key, m))?;
        }
        if self.protocol == Protocol::Icmp && self.families() == (true, true) {
            return Err(rule_error(
                "protocol",
                "\"icmp\" means ICMP for IPv4 sources and ICMPv6 for IPv6 sources, and one rule \
                 cannot match both: this rule's sources mix IPv4 and IPv6 prefixes; split it into \
                 one rule per family",
            ));
        }
        Ok(())
    }
}

/// The error for a limit-only key (`field`) on an allow or deny rule.
pub(crate) fn no_meaning(field: &'static str, action: Action) -> RuleError {
    rule_error(
        field,
        format!(
            "has no meaning for {} {action} rule (only limit rules take rates, per and scope)",
            if matches!(action, Action::Allow) {
                "an"
            } else {
                "a"
            }
        ),
    )
}

/// Checks a limit's packet and byte pairs, `(rate, burst)` and `(bytes_rate, bytes_burst)`: at
/// least one rate, each pair in its bounds. `what` names the limit in the error ("a limit rule",
/// "a limit").
fn check_rates(
    (rate, burst): (Option<u64>, Option<u64>),
    (bytes_rate, bytes_burst): (Option<u64>, Option<u64>),
    what: &str,
) -> Result<(), RuleError> {
    if rate.is_none() && bytes_rate.is_none() {
        return Err(rule_error(
            "rate",
            format!("{what} needs `rate` (packets/s) or `bytes_rate` (bytes/s), or both"),
        ));
    }
    check_limit(
        ("rate", rate),
        ("burst", burst),
        (1, MAX_RATE, 1),
        "packets",
    )?;
    check_limit(
        ("bytes_rate", bytes_rate),
        ("bytes_burst", bytes_burst),
        (1, MAX_BYTES_RATE, MIN_BYTES_BURST),
        "bytes",
    )
}

/// Checks one rate/burst pair. `bounds` is (min rate, max rate, min burst).
pub(super) fn check_limit(
    (rate_key, rate): (&'static str, Option<u64>),
    (burst_key, burst): (&'static str, Option<u64>),
    (min_rate, max_rate, min_burst): (u64, u64, u64),
    unit: &str,
) -> Result<(), RuleError> {
    let Some(rate) = rate else {
        return match burst {
            Some(_) => Err(rule_error(
                burst_key,
                format!("is set but `{rate_key}` is not"),
            )),
            None => Ok(()),
        };
    };
    if !(min_rate..=max_rate).contains(&rate) {
        return Err(rule_error(
            rate_key,
            format!("must be between {min_rate} and {max_rate} {unit}/s (got {rate})"),
        ));
    }
    let burst = burst.ok_or_else(|| rule_error(burst_key, "must be set when the rate is"))?;
    if burst < min_burst {
        let why = if min_burst > 1 {
            " (one full-size Ethernet frame)"
        } else {
            ""
        };
        return Err(rule_error(
            burst_key,
            format!("must be at least {min_burst}{why} (got {burst})"),
        ));
    }
    // The kernel stores burst/rate as a nanosecond tolerance; an hour bounds it far from overflow
    // and nobody means a bucket that takes longer than that to refill.
    let refill_ns = u128::from(burst) * u128::from(NS_PER_SEC) / u128::from(rate);
    if refill_ns > u128::from(MAX_TOLERANCE_NS) {
        return Err(rule_error(
            burst_key,
            format!(
                "{burst} {unit} at {rate} {unit}/s take {} s to refill; at most 3600 s (one hour) is allowed: \
                 raise `{rate_key}` or lower `{burst_key}` to at most {}",
                refill_ns / u128::from(NS_PER_SEC),
                rate.saturating_mul(3600),
            ),
        ));
    }
    Ok(())
}

/// Checks a rule name: 1 to 64 bytes of letters, digits, `_`, `.` and `-`.
///
/// # Errors
/// What is wrong with it.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "is {} characters long; at most {MAX_NAME_LEN} are allowed",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(format!(
            "{name:?} contains {c:?}; only letters, digits, '_', '.' and '-' are allowed"
        ));
    }
    Ok(())
}

pub(super) fn validate_source(net: &IpNet) -> Result<(), String> {
    let network = net.trunc();
    if network != *net {
        return Err(format!(
            "{net} has host bits set; did you mean \"{network}\" (or \"{}/{}\" for the single address)?",
            net.addr(),
            net.max_prefix_len()
        ));
    }
    // The XDP program keys IPv4 packets as IPv4, so an IPv4-mapped IPv6 prefix would never match.
    let mapped =
        Ipv6Net::new(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96).expect("valid prefix");
    if let IpNet::V6(v6) = net {
        if v6.prefix_len() >= 96 && mapped.contains(v6) {
            let v4 = v6.addr().to_ipv4_mapped().expect("inside ::ffff:0:0/96");
            return Err(format!(
                "{net} is an IPv4-mapped IPv6 prefix, which IPv4 packets never match; write \"{v4}/{}\"",
                v6.prefix_len() - 96
            ));
        }
    }
    Ok(())
}

/// Parses a rule's `source`: a CIDR, or a bare address meaning a single host.
pub(super) fn parse_source(text: &str) -> Result<IpNet, String> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net);
    }
    if let Ok(addr) = text.parse::<IpAddr>() {
        return Ok(IpNet::from(addr));
    }
    Err(format!(
        "{text:?} is not an IPv4 or IPv6 CIDR (such as \"10.0.0.0/8\" or \"2001:db8::/32\") or address"
    ))
}

/// The burst a TCP flow needs, in seconds of the rate: a flow whose window's tail a policer
/// drops waits out Linux's 200 ms minimum RTO, so it sends about one burst per 200 ms and its
/// goodput is about `burst x 5` per second. `suggest` proposes no less for a TCP rule.
pub const TCP_BURST_SECS: f64 = 0.2;
/// `check` warns of a TCP limit whose burst (packets or bytes) is below this many seconds of
/// its rate: half of [`TCP_BURST_SECS`], where such a flow gets at most half its rate.
pub const TCP_BURST_WARN_SECS: f64 = 0.1;

/// Warnings (not errors) about a TCP rule whose bursts are below `rate x 0.1 s`
/// ([`TCP_BURST_WARN_SECS`]), packets against `rate` and bytes against `bytes_rate`: such a
/// flow's goodput falls to about `burst x 5` per second, under half its rate. One per limit and
/// kind at fault, naming the rule, the limit (1 its own, 2.. its `[[rule.limit]]`s) and its line.
#[must_use]
#[expect(clippy::cast_precision_loss, reason = "rates, compared")]
pub fn tcp_burst_warnings(rule: &RuleConfig) -> Vec<String> {
    if rule.protocol != Protocol::Tcp || rule.action != Action::Limit {
        return Vec::new();
    }
    let own = (
        rule.line,
        (rule.rate, rule.burst),
        (rule.bytes_rate, rule.bytes_burst),
    );
    let extra = rule
        .limits
        .iter()
        .map(|l| (l.line, (l.rate, l.burst), (l.bytes_rate, l.bytes_burst)));
    let mut out = Vec::new();
    for (k, (line, pkts, bytes)) in std::iter::once(own).chain(extra).enumerate() {
        let kinds = [
            (pkts, "rate", "burst", "packets"),
            (bytes, "bytes_rate", "bytes_burst", "bytes"),
        ];
        for ((rate, burst), per, what, unit) in kinds {
            let Some(rate) = rate else { continue };
            let burst = burst.unwrap_or(rate);
            if (burst as f64) < rate as f64 * TCP_BURST_WARN_SECS {
                out.push(format!(
                    "line {line}: rule {:?}, limit {}: {what} {burst} is below {per} x \
                     {TCP_BURST_WARN_SECS} s = {:.0}, half the {:.0} a TCP flow needs \
                     ({per} x {TCP_BURST_SECS} s): a flow whose burst is cut waits out TCP's \
                     200 ms minimum RTO, and its goodput falls to about {what} x 5 = {} {unit}/s",
                    rule.name,
                    k + 1,
                    rate as f64 * TCP_BURST_WARN_SECS,
                    rate as f64 * TCP_BURST_SECS,
                    burst.saturating_mul(5)
                ));
            }
        }
    }
    out
}
