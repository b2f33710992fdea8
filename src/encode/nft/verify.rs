//! Compares the ruleset we expect with what the kernel holds; every difference is one sentence an
//! operator can act on. Rules are compared by fingerprint (rule text hash stored in the rule's user
//! data), so a rule added or edited by hand shows up as foreign. The elements of dynamic sets
//! (added by the packet path) are not compared.

use super::KernelTable;
use super::encode::{fingerprint, key_type_id};
use crate::core::ruleset::ir::{self, Ruleset, SetKind};

pub fn verify(expected: &Ruleset, actual: Option<&KernelTable>) -> Vec<String> {
    let mut out = Vec::new();
    let Some(actual) = actual else {
        out.push(format!("table inet {} is missing", ir::TABLE_NAME));
        return out;
    };
    out.extend(actual.problems.iter().cloned());
    for (name, chain) in &expected.chains {
        let Some(k) = actual.chains.get(&**name) else {
            out.push(format!("chain {name} is missing"));
            continue;
        };
        match (&chain.base, &k.base) {
            (None, None) => {}
            (Some(b), Some(h)) => {
                if h.chain_type != b.chain_type.name()
                    || h.hook != b.hook.number()
                    || h.priority != b.priority
                {
                    out.push(format!(
                        "chain {name}: is type {} hook {} priority {}, expected type {} hook {} priority {}",
                        h.chain_type,
                        h.hook,
                        h.priority,
                        b.chain_type.name(),
                        b.hook.name(),
                        b.priority
                    ));
                }
                if h.policy.is_some_and(|p| p != 1) {
                    out.push(format!("chain {name}: policy is not accept"));
                }
            }
            (Some(_), None) => out.push(format!("chain {name}: is a regular chain, expected a base chain")),
            (None, Some(_)) => out.push(format!("chain {name}: is a base chain, expected a regular chain")),
        }
        for (i, want) in chain.rules.iter().enumerate() {
            match k.rules.get(i) {
                None => out.push(format!("chain {name}: rule {i} `{}` missing", ir::render_rule(want))),
                Some(r) => match r.fingerprint {
                    None => out.push(format!("chain {name}: rule {i} is not ours (foreign rule)")),
                    Some(f) if f != fingerprint(want) => out.push(format!(
                        "chain {name}: rule {i} differs, expected `{}`",
                        ir::render_rule(want)
                    )),
                    Some(_) => {}
                },
            }
        }
        for (i, r) in k.rules.iter().enumerate().skip(chain.rules.len()) {
            if r.fingerprint.is_none() {
                out.push(format!("chain {name}: rule {i} is not ours (foreign rule)"));
            } else {
                out.push(format!("chain {name}: rule {i} is unexpected"));
            }
        }
    }
    for name in actual.chains.keys() {
        if !expected.chains.contains_key(name.as_str()) {
            out.push(format!("chain {name} is unexpected"));
        }
    }
    for (name, counter) in &expected.counters {
        match actual.counters.get(&**name) {
            None => out.push(format!("counter {name} is missing")),
            Some(k) if k.comment != counter.comment => out.push(format!("counter {name}: comment differs")),
            Some(_) => {}
        }
    }
    for name in actual.counters.keys() {
        if !expected.counters.contains_key(name.as_str()) {
            out.push(format!("counter {name} is unexpected"));
        }
    }
    for name in &actual.other_objects {
        out.push(format!("object {name} is unexpected (not a counter)"));
    }
    for (name, set) in &expected.sets {
        let kind = set.kind.word();
        let Some(k) = actual.sets.get(&**name) else {
            out.push(format!("{kind} {name} is missing"));
            continue;
        };
        if k.key_type_id != key_type_id(&set.key) || k.kind != Some(set.kind) {
            out.push(format!("{kind} {name}: has a different type"));
            continue;
        }
        if matches!(set.kind, SetKind::Dynamic { .. }) {
            // Its elements are the packet path's (affinities), never ours to compare.
            continue;
        }
        for (key, v) in &set.elements {
            match k.elements.get(key) {
                None => out.push(format!("{kind} {name}: element {} missing", ir::render_key(key))),
                Some(kv) if kv != v => out.push(format!(
                    "{kind} {name}: element {} maps to {}, expected {}",
                    ir::render_key(key),
                    kv.as_ref().map(ir::render_mapped).unwrap_or_default(),
                    v.as_ref().map(ir::render_mapped).unwrap_or_default()
                )),
                Some(_) => {}
            }
        }
        for key in k.elements.keys() {
            if !set.elements.contains_key(key) {
                out.push(format!("{kind} {name}: element {} is unexpected", ir::render_key(key)));
            }
        }
    }
    for (name, s) in &actual.sets {
        if !expected.sets.contains_key(name.as_str()) {
            out.push(format!("{} {name} is unexpected", s.kind.map_or("set", |k| k.word())));
        }
    }
    out
}
