//! Hostile values from fuzzer bytes: strings built from pieces that mean something to nodelb's
//! parsers (port maps, CIDRs, booleans, names, numbers at the edges), arbitrary JSON, and
//! mutations of valid Kubernetes objects at the paths nodelb reads.

use arbitrary::{Result, Unstructured};
use serde_json::{Map, Number, Value, json};

/// Fragments the parsers react to. Joined in any order, they make most of the interesting
/// malformed values (`80/TCP=20080,`, `10.0.0.1/33`, `service,80=1`, ...).
const PIECES: &[&str] = &[
    "",
    " ",
    ",",
    "=",
    "/",
    ":",
    "-",
    ".",
    "*",
    "\n",
    "\t",
    "\0",
    "80",
    "0",
    "1",
    "20080",
    "65535",
    "65536",
    "-1",
    "4294967296",
    "99999999999999999999999",
    "TCP",
    "UDP",
    "SCTP",
    "tcp",
    "ICMP",
    "80/TCP=20080",
    "53/UDP=20053",
    "80=20081",
    "service",
    "SERVICE",
    "true",
    "false",
    " TRUE ",
    "yes",
    "LoadBalancer",
    "ClusterIP",
    "Local",
    "Cluster",
    "Global",
    "IPv4",
    "IPv6",
    "ipv4",
    "ipv4,ipv6",
    "22/TCP,20005/UDP",
    "10.0.0.0/8",
    "10.0.0.1/33",
    "0.0.0.0/0",
    "::/0",
    "2001:db8::/32",
    "2001:db8::1",
    "198.51.100.20",
    "203.0.113.7/32",
    "127.0.0.1",
    "169.254.169.254",
    "::ffff:198.51.100.1",
    "255.255.255.255",
    "nodelb.io/nodelb",
    "good",
    "web",
    "a/b",
    "node-1",
    "2024-01-01T00:00:00Z",
    "1970-01-01T00:00:00Z",
    "é",
    "💥",
    "\u{202e}",
];

/// A string made of 0–5 pieces or raw characters, sometimes repeated into a long value.
pub fn string(u: &mut Unstructured<'_>) -> Result<String> {
    let mut s = String::new();
    for _ in 0..u.int_in_range(0..=5)? {
        if u.ratio(3, 4)? {
            s.push_str(u.choose(PIECES)?);
        } else {
            s.push(u.arbitrary::<char>()?);
        }
    }
    if u.ratio(1, 16)? {
        // Long values: annotation and name limits, comment truncation, message sizes.
        let n = u.int_in_range(2..=20_000)?;
        s = s.repeat(n).chars().take(300_000).collect();
    }
    Ok(s)
}

/// Any JSON value, at most `depth` levels deep.
pub fn json(u: &mut Unstructured<'_>, depth: u32) -> Result<Value> {
    let choices = if depth == 0 { 5 } else { 7 };
    Ok(match u.int_in_range(0..=choices - 1)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => match u.int_in_range(0..=3)? {
            0 => json!(u.arbitrary::<i64>()?),
            1 => json!(u.arbitrary::<u64>()?),
            2 => Number::from_f64(u.arbitrary::<f64>()?).map_or(Value::Null, Value::Number),
            _ => json!(u.choose(&[0i64, 1, 80, 65535, 65536, -1, i64::from(i32::MAX) + 1])?),
        },
        3 | 4 => Value::String(string(u)?),
        5 => {
            let n = u.int_in_range(0..=4)?;
            Value::Array((0..n).map(|_| json(u, depth - 1)).collect::<Result<_>>()?)
        }
        _ => {
            let mut m = Map::new();
            for _ in 0..u.int_in_range(0..=4)? {
                m.insert(string(u)?, json(u, depth - 1)?);
            }
            Value::Object(m)
        }
    })
}

/// A value for a field that is usually a string: mostly strings, sometimes anything.
pub fn stringish(u: &mut Unstructured<'_>) -> Result<Value> {
    if u.ratio(4, 5)? { Ok(Value::String(string(u)?)) } else { json(u, 2) }
}

/// A value for a field that is usually a number.
pub fn numberish(u: &mut Unstructured<'_>) -> Result<Value> {
    if u.ratio(4, 5)? {
        Ok(json!(u.choose(&[0i64, 1, 53, 80, 443, 8080, 20080, 65535, 65536, -1, 1 << 31, -(1 << 40)])?))
    } else {
        json(u, 1)
    }
}

/// The paths of a Service nodelb reads (and a few it does not), with a generator for each.
type Gen = fn(&mut Unstructured<'_>) -> Result<Value>;

pub const SERVICE_PATHS: &[(&[&str], Gen)] = &[
    (&["metadata", "name"], stringish),
    (&["metadata", "namespace"], stringish),
    (&["metadata", "uid"], stringish),
    (&["metadata", "resourceVersion"], stringish),
    (&["metadata", "creationTimestamp"], stringish),
    (&["metadata", "generation"], numberish),
    (&["metadata", "annotations", "nodelb.io/ports"], stringish),
    (&["metadata", "annotations", "nodelb.io/allocated-ports"], stringish),
    (&["metadata", "annotations", "nodelb.io/ignore"], stringish),
    (&["metadata", "annotations", "service.beta.kubernetes.io/load-balancer-source-ranges"], stringish),
    (&["metadata", "annotations"], any),
    (&["metadata"], any),
    (&["spec", "type"], stringish),
    (&["spec", "loadBalancerClass"], stringish),
    (&["spec", "externalTrafficPolicy"], stringish),
    (&["spec", "ipFamilies"], string_list),
    (&["spec", "clusterIP"], stringish),
    (&["spec", "clusterIPs"], string_list),
    (&["spec", "loadBalancerSourceRanges"], string_list),
    (&["spec", "ports"], ports),
    (&["spec", "ports", "0", "port"], numberish),
    (&["spec", "ports", "0", "protocol"], stringish),
    (&["spec", "ports", "0", "name"], stringish),
    (&["spec", "ports", "1", "port"], numberish),
    (&["spec", "ports", "1", "name"], stringish),
    (&["spec"], any),
    (&["status"], any),
    (&["status", "conditions"], any),
    (&["status", "loadBalancer", "ingress"], any),
];

pub const SLICE_PATHS: &[(&[&str], Gen)] = &[
    (&["metadata", "name"], stringish),
    (&["metadata", "namespace"], stringish),
    (&["metadata", "labels", "kubernetes.io/service-name"], stringish),
    (&["metadata", "labels"], any),
    (&["addressType"], stringish),
    (&["endpoints"], endpoints),
    (&["endpoints", "0", "addresses"], string_list),
    (&["endpoints", "0", "addresses", "0"], stringish),
    (&["endpoints", "0", "nodeName"], stringish),
    (&["endpoints", "0", "conditions"], any),
    (&["endpoints", "0", "conditions", "ready"], any),
    (&["endpoints", "0", "conditions", "terminating"], any),
    (&["endpoints", "1", "addresses"], string_list),
    (&["ports"], ports),
    (&["ports", "0", "port"], numberish),
    (&["ports", "0", "name"], stringish),
    (&["ports", "0", "protocol"], stringish),
];

pub const NODE_PATHS: &[(&[&str], Gen)] = &[
    (&["metadata", "name"], stringish),
    (&["metadata", "labels"], any),
    (&["metadata", "deletionTimestamp"], stringish),
    (&["status", "addresses"], any),
    (&["status", "addresses", "0", "address"], stringish),
    (&["status", "addresses", "0", "type"], stringish),
];

pub const LEASE_PATHS: &[(&[&str], Gen)] = &[
    (&["metadata", "name"], stringish),
    (&["metadata", "annotations", "nodelb.io/families"], stringish),
    (&["metadata", "annotations", "nodelb.io/listening-ports"], stringish),
    (&["spec", "renewTime"], stringish),
    (&["spec", "leaseDurationSeconds"], numberish),
    (&["spec", "holderIdentity"], stringish),
];

fn any(u: &mut Unstructured<'_>) -> Result<Value> {
    json(u, 3)
}

fn string_list(u: &mut Unstructured<'_>) -> Result<Value> {
    if u.ratio(1, 8)? {
        return json(u, 2);
    }
    let n = u.int_in_range(0..=4)?;
    Ok(Value::Array((0..n).map(|_| stringish(u)).collect::<Result<_>>()?))
}

/// A `ports` list of a Service or an EndpointSlice (same fields).
fn ports(u: &mut Unstructured<'_>) -> Result<Value> {
    let n = u.int_in_range(0..=4)?;
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(json!({"port": numberish(u)?, "protocol": stringish(u)?, "name": stringish(u)?}));
    }
    Ok(Value::Array(out))
}

fn endpoints(u: &mut Unstructured<'_>) -> Result<Value> {
    let n = u.int_in_range(0..=4)?;
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(json!({
            "addresses": string_list(u)?,
            "conditions": {"ready": json(u, 0)?, "serving": json(u, 0)?, "terminating": json(u, 0)?},
            "nodeName": stringish(u)?,
        }));
    }
    Ok(Value::Array(out))
}

/// Applies 1–6 mutations to `v` at the given paths: set a generated value, or remove the field.
pub fn mutate(u: &mut Unstructured<'_>, v: &mut Value, paths: &[(&[&str], Gen)]) -> Result<()> {
    for _ in 0..u.int_in_range(1..=6)? {
        let (path, make) = u.choose(paths)?;
        if u.ratio(1, 6)? {
            remove(v, path);
        } else {
            let value = make(u)?;
            set(v, path, value);
        }
    }
    Ok(())
}

/// Sets `path` (object keys, or array indexes written as numbers), creating objects on the way;
/// an index past the end of an array appends.
pub fn set(v: &mut Value, path: &[&str], value: Value) {
    let Some((last, parents)) = path.split_last() else {
        *v = value;
        return;
    };
    let mut cur = v;
    for key in parents {
        cur = match cur {
            Value::Array(a) => {
                let i = key.parse::<usize>().unwrap_or(0);
                if i >= a.len() {
                    a.push(json!({}));
                }
                let i = i.min(a.len() - 1);
                &mut a[i]
            }
            other => {
                if !other.is_object() {
                    *other = json!({});
                }
                other.as_object_mut().expect("object").entry(key.to_string()).or_insert(json!({}))
            }
        };
    }
    match cur {
        Value::Array(a) => {
            let i = last.parse::<usize>().unwrap_or(0);
            if i < a.len() {
                a[i] = value;
            } else {
                a.push(value);
            }
        }
        other => {
            if !other.is_object() {
                *other = json!({});
            }
            other.as_object_mut().expect("object").insert(last.to_string(), value);
        }
    }
}

fn remove(v: &mut Value, path: &[&str]) {
    let Some((last, parents)) = path.split_last() else { return };
    let mut cur = v;
    for key in parents {
        cur = match cur {
            Value::Object(m) => match m.get_mut(*key) {
                Some(next) => next,
                None => return,
            },
            Value::Array(a) => match key.parse::<usize>().ok().and_then(|i| a.get_mut(i)) {
                Some(next) => next,
                None => return,
            },
            _ => return,
        };
    }
    if let Value::Object(m) = cur {
        m.remove(*last);
    }
}
