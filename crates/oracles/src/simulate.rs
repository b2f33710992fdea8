//! The planner's model of the kernel: applies a change list to an in-memory ruleset the way
//! nf_tables takes a batch (a test oracle: a diff applied to `old` must give exactly `new`, and
//! the agent's fake kernel is built on it).

use std::collections::BTreeMap;

use nodelb_core::ruleset::ir::{Chain, Change, Mapped, Ruleset, Set, SetKind, Table, Verdict};

/// Applies changes to an in-memory ruleset the way the kernel would (a model for tests: a diff
/// applied to `old` must give exactly `new`). Returns an error naming the first change the kernel
/// would refuse (missing object or table, object still referenced, a reference to another
/// table, duplicate). `start`'s tables exist (the main one always).
pub fn simulate(start: &Ruleset, changes: &[Change]) -> Result<Ruleset, String> {
    let mut rs = start.clone();
    let mut exists = start.tables();
    for change in changes {
        if let Some(name) = object_of(change)
            && !exists.contains(&Table::of_name(name))
        {
            return Err(format!("{change:?}: no table {}", Table::of_name(name).name()));
        }
        match change {
            Change::AddTable(t) => {
                exists.insert(*t);
            }
            Change::DeleteTable(t) => {
                if !exists.remove(t) {
                    return Err(format!("delete table {}: no such table", t.name()));
                }
                let other = |name: &str| Table::of_name(name) != *t;
                rs.chains.retain(|n, _| other(n));
                rs.sets.retain(|n, _| other(n));
                rs.counters.retain(|n, _| other(n));
            }
            Change::AddChain(c) => {
                rs.chains.entry(c.name.clone()).or_insert_with(|| Chain { rules: vec![], ..c.clone() });
            }
            Change::FlushChain(n) => {
                rs.chains.get_mut(n).ok_or(format!("flush chain {n}: missing"))?.rules.clear();
            }
            Change::DeleteChain(n) => {
                let c = rs.chains.get(n).ok_or(format!("delete chain {n}: missing"))?;
                if !c.rules.is_empty() {
                    return Err(format!("delete chain {n}: not empty"));
                }
                if references(&rs, n) {
                    return Err(format!("delete chain {n}: still referenced"));
                }
                rs.chains.remove(n);
            }
            Change::AddRule { chain, rule } => {
                let table = Table::of_name(chain);
                if let Some(n) = rule
                    .targets()
                    .chain(rule.sets())
                    .chain(rule.counters())
                    .find(|n| Table::of_name(n) != table)
                {
                    return Err(format!("add rule to {chain}: {n} is in table {}", Table::of_name(n).name()));
                }
                for target in rule.targets() {
                    if !rs.chains.contains_key(target) {
                        return Err(format!("add rule to {chain}: jump to missing chain {target}"));
                    }
                }
                for set in rule.sets() {
                    if !rs.sets.contains_key(set) {
                        return Err(format!("add rule to {chain}: missing set {set}"));
                    }
                }
                for name in rule.counters() {
                    if !rs.counters.contains_key(name) {
                        return Err(format!("add rule to {chain}: missing counter {name}"));
                    }
                }
                rs.chains
                    .get_mut(chain)
                    .ok_or(format!("add rule: chain {chain} missing"))?
                    .rules
                    .push(rule.clone());
            }
            Change::AddSet(s) => {
                rs.sets
                    .entry(s.name.clone())
                    .or_insert_with(|| Set { elements: BTreeMap::new(), ..s.clone() });
            }
            Change::DeleteSet(n) => {
                if rs.chains.values().any(|c| c.rules.iter().any(|r| r.sets().any(|s| s == n))) {
                    return Err(format!("delete set {n}: still referenced"));
                }
                rs.sets.remove(n).ok_or(format!("delete set {n}: missing"))?;
            }
            Change::AddDynamicElements { set, .. } => {
                // The elements are state, not configuration: the model keeps none.
                match rs.sets.get(set) {
                    Some(s) if matches!(s.kind, SetKind::Dynamic { .. }) => {}
                    Some(_) => return Err(format!("put back elements of {set}: not a dynamic set")),
                    None => return Err(format!("put back elements of {set}: set missing")),
                }
            }
            Change::AddElements { set, elements } => {
                let s = rs.sets.get_mut(set).ok_or(format!("add elements: set {set} missing"))?;
                for (k, v) in elements {
                    if s.elements.contains_key(k) {
                        return Err(format!("add element to {set}: {k:?} exists"));
                    }
                    s.elements.insert(*k, v.clone());
                }
                for (_, v) in elements {
                    let named = match v {
                        Some(Mapped::Verdict(Verdict::Goto(c) | Verdict::Jump(c)) | Mapped::Counter(c)) => {
                            Some(c)
                        }
                        _ => None,
                    };
                    if let Some(c) = named.filter(|c| Table::of_name(c) != Table::of_name(set)) {
                        return Err(format!(
                            "add element to {set}: {c} is in table {}",
                            Table::of_name(c).name()
                        ));
                    }
                    match v {
                        Some(Mapped::Verdict(Verdict::Goto(c) | Verdict::Jump(c)))
                            if !rs.chains.contains_key(c) =>
                        {
                            return Err(format!("add element to {set}: missing chain {c}"));
                        }
                        Some(Mapped::Counter(c)) if !rs.counters.contains_key(c) => {
                            return Err(format!("add element to {set}: missing counter {c}"));
                        }
                        _ => {}
                    }
                }
            }
            Change::DeleteElements { set, keys } => {
                let s = rs.sets.get_mut(set).ok_or(format!("delete elements: set {set} missing"))?;
                for k in keys {
                    s.elements.remove(k).ok_or(format!("delete element from {set}: {k:?} missing"))?;
                }
            }
            Change::AddCounter(c) => {
                rs.counters.entry(c.name.clone()).or_insert_with(|| c.clone());
            }
            Change::DeleteCounter(n) => {
                if !rs.counters.contains_key(n) {
                    return Err(format!("delete counter {n}: missing"));
                }
                if counter_referenced(&rs, n) {
                    return Err(format!("delete counter {n}: still referenced"));
                }
                rs.counters.remove(n);
            }
        }
    }
    if !exists.contains(&Table::Main) {
        return Err("table deleted at the end".into());
    }
    Ok(rs)
}

/// The object a change adds, changes or deletes, by name (its table must exist).
fn object_of(change: &Change) -> Option<&str> {
    match change {
        Change::AddTable(_) | Change::DeleteTable(_) => None,
        Change::AddChain(c) => Some(&c.name),
        Change::AddSet(s) => Some(&s.name),
        Change::AddCounter(c) => Some(&c.name),
        Change::FlushChain(n) | Change::DeleteChain(n) | Change::DeleteSet(n) | Change::DeleteCounter(n) => {
            Some(n)
        }
        Change::AddRule { chain, .. } => Some(chain),
        Change::AddElements { set, .. }
        | Change::DeleteElements { set, .. }
        | Change::AddDynamicElements { set, .. } => Some(set),
    }
}

fn references(rs: &Ruleset, chain: &str) -> bool {
    rs.chains.values().any(|c| c.rules.iter().any(|r| r.targets().any(|t| &**t == chain)))
        || rs.sets.values().any(|s| {
            s.elements.values().any(
                |v| matches!(v, Some(Mapped::Verdict(Verdict::Goto(c) | Verdict::Jump(c))) if &**c == chain),
            )
        })
}

fn counter_referenced(rs: &Ruleset, counter: &str) -> bool {
    rs.chains.values().any(|c| c.rules.iter().any(|r| r.counters().any(|n| &**n == counter)))
        || rs
            .sets
            .values()
            .any(|s| s.elements.values().any(|v| matches!(v, Some(Mapped::Counter(c)) if &**c == counter)))
}
