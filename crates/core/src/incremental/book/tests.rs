use std::collections::BTreeSet;

use super::*;
use crate::domain::Protocol;

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

fn ports(numbers: &[u16]) -> BTreeMap<PortId, u16> {
    numbers
        .iter()
        .enumerate()
        .map(|(i, n)| (PortId { port: 80 + i as u16, protocol: Protocol::Tcp }, *n))
        .collect()
}

fn names(scope: &foldhash::HashSet<ServiceKey>) -> BTreeSet<String> {
    scope.iter().map(|k| k.name.to_string()).collect()
}

/// The scope is what changed, what is unsettled, and whoever shares a number with them,
/// transitively; nobody else.
#[test]
fn the_scope_is_closed_under_shared_numbers() {
    let mut book = AllocationBook::default();
    let decided: Allocations = [
        (key("a"), ports(&[20001])),
        (key("b"), ports(&[20002, 20003])),
        (key("c"), ports(&[20004])),
        (key("d"), ports(&[20005])),
    ]
    .into();
    book.replace(decided, Some([key("stuck")].into_iter().collect()));
    // The view's annotations: e names b's 20002 (a duplicate), b also holds 20003, which c's
    // annotation does not name; d is on its own.
    let view: Vec<(ServiceKey, Vec<u16>)> = [
        ("a", &[20001][..]),
        ("b", &[20002, 20003]),
        ("c", &[20004]),
        ("d", &[20005]),
        ("e", &[20002, 20004]),
    ]
    .into_iter()
    .map(|(n, numbers)| (key(n), numbers.to_vec()))
    .collect();
    let annotated =
        |k: &ServiceKey| view.iter().find(|(h, _)| h == k).map(|(_, n)| n.clone()).unwrap_or_default();
    let holders = |n: u16| view.iter().filter(move |(_, ns)| ns.contains(&n)).map(|(k, _)| k);
    let closure = |changed: &[&str], numbers: &[u16]| {
        names(&book.closure(changed.iter().map(|n| key(n)), numbers.iter().copied(), annotated, holders))
    };

    // Nothing changed: the unsettled Service alone.
    assert_eq!(closure(&[], &[]), ["stuck".to_string()].into());
    // a changed, alone with its number.
    assert_eq!(closure(&["a"], &[20001]), ["a", "stuck"].map(String::from).into());
    // e is new and names 20002 (b's) and 20004 (c's): b and c join, and b's other number
    // brings nobody else.
    assert_eq!(closure(&["e"], &[20002, 20004]), ["b", "c", "e", "stuck"].map(String::from).into());
    // A deletion of d: its old number brings whoever names it (nobody).
    assert_eq!(closure(&["d"], &[20005]), ["d", "stuck"].map(String::from).into());
    // Via the decision alone: a change without numbers still brings what it was given.
    assert_eq!(closure(&["b"], &[]), ["b", "e", "c", "stuck"].map(String::from).into());
}

/// Where the pass does not allocate, only annotations couple Services, and nothing is unsettled.
#[test]
fn without_allocating_only_annotations_couple() {
    let mut book = AllocationBook::default();
    book.replace([(key("a"), ports(&[20001])), (key("b"), ports(&[20001]))].into(), None);
    let annotated = |_: &ServiceKey| Vec::new();
    let holders = |_: u16| std::iter::empty::<&ServiceKey>();
    assert_eq!(names(&book.closure([key("a")], [], annotated, holders)), ["a".to_string()].into());
    assert!(book.elsewhere(&Default::default()).is_none());
}

/// A patch replaces the scope's decisions and numbers, and nothing else.
#[test]
fn a_patch_replaces_the_scope_only() {
    let mut book = AllocationBook::default();
    book.replace(
        [(key("a"), ports(&[20001])), (key("b"), ports(&[20002]))].into(),
        Some([key("b")].into_iter().collect()),
    );
    let scope: foldhash::HashSet<ServiceKey> = [key("b"), key("c")].into_iter().collect();
    book.patch(&scope, [(key("c"), ports(&[20002]))].into(), Default::default());
    assert_eq!(book.allocations().keys().map(|k| k.name.to_string()).collect::<Vec<_>>(), ["a", "c"]);
    let numbers = &book.index.as_ref().expect("allocating").numbers;
    assert_eq!(numbers.holders(20002).next(), Some(&key("c")));
    assert_eq!(numbers.holders(20001).next(), Some(&key("a")));
    assert!(!book.is_unsettled(&key("b")));
    let none: foldhash::HashSet<ServiceKey> = Default::default();
    let elsewhere = book.elsewhere(&none).expect("allocating");
    assert_eq!(elsewhere.held.len(), 2);
}
