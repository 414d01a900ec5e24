//! The limit rules in force with a cluster-scoped limit, and the keys of those limits' buckets.

use std::collections::HashMap;

use ratelimit_common::{action, rule_flags, Limit, Rule};

use crate::{
    cluster::{
        publish::KeyName,
        remote::{ClusterLimits, Limits},
    },
    compile::CompiledRuleSet,
    maps::bucket::bucket_addr,
};

/// The limit rules in force here with at least one cluster-scoped limit (their own, or a
/// `[[rule.limit]]`), by name; only the buckets of their cluster-scoped limits are published
/// and charged.
#[derive(Clone, Debug, Default)]
pub struct ClusterRules {
    pub(super) by_name: HashMap<String, (u32, Rule)>,
    by_id: HashMap<u32, String>,
}

impl ClusterRules {
    /// The rules of `set` with a cluster-scoped limit.
    #[must_use]
    pub fn of(set: &CompiledRuleSet) -> Self {
        let mut rules = Self::default();
        for r in &set.rules {
            if r.rule.action == action::LIMIT && cluster_limits(&r.rule).next().is_some() {
                rules.by_name.insert(r.name.clone(), (r.id, r.rule));
                rules.by_id.insert(r.id, r.name.clone());
            }
        }
        rules
    }

    /// Every cluster-scoped limit, by rule name and index.
    #[must_use]
    pub fn limits(&self) -> ClusterLimits {
        let mut out = ClusterLimits::default();
        for (name, (_, r)) in &self.by_name {
            for (k, l) in cluster_limits(r) {
                out.insert(name, k, Limits::of(&l));
            }
        }
        out
    }

    /// The rule (id and record) and limit `name` stands for, if that limit is cluster-scoped.
    pub(super) fn limit_of(&self, name: &KeyName) -> Option<(u32, &Rule, Limit)> {
        let (id, rule) = self.by_name.get(&name.rule)?;
        let l = rule.limit(usize::from(name.limit))?;
        (l.flags & rule_flags::CLUSTER != 0).then_some((*id, rule, l))
    }

    /// The key of the bucket `b` under its rule's name, if that bucket belongs to a
    /// cluster-scoped limit.
    pub(super) fn key_of(&self, b: &ratelimit_common::Bucket) -> Option<KeyName> {
        let (id, limit) = ratelimit_common::split_bucket_rule(u32::from(b.rule));
        let name = self.by_id.get(&id)?;
        let (_, rule) = self.by_name.get(name)?;
        let l = rule.limit(limit)?;
        (l.flags & rule_flags::CLUSTER != 0).then(|| KeyName {
            rule: name.clone(),
            limit: u8::try_from(limit).unwrap_or(u8::MAX),
            addr: bucket_addr(&b.key()),
        })
    }
}

/// The cluster-scoped limits of `rule`, with their indices.
fn cluster_limits(rule: &Rule) -> impl Iterator<Item = (u8, Limit)> + '_ {
    (0..rule.limits()).filter_map(|k| {
        let l = rule.limit(k)?;
        (l.flags & rule_flags::CLUSTER != 0).then(|| (u8::try_from(k).unwrap_or(u8::MAX), l))
    })
}
