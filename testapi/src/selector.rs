//! Label and field selectors (the query-string syntax of `labelSelector` / `fieldSelector`).

use serde_json::Value;

use crate::error::ApiError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Req {
    Eq(String, String),
    NotEq(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector: requirements ANDed together. Empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Req>);

/// Split at commas that are not inside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63 && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn set_values(rest: &str) -> Option<Vec<String>> {
    let rest = rest.trim();
    let inner = rest.strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(|v| v.trim().to_string()).collect())
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let bad = |t: &str| {
            ApiError::bad_request(format!("unable to parse requirement: invalid label selector: {t:?}"))
        };
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(LabelSelector(reqs));
        }
        for term in split_terms(s) {
            let t = term.trim();
            let req = if let Some(k) = t.strip_prefix('!') {
                Req::NotExists(k.trim().to_string())
            } else if let Some((k, rest)) = t.split_once(" notin ") {
                Req::NotIn(k.trim().to_string(), set_values(rest).ok_or_else(|| bad(t))?)
            } else if let Some((k, rest)) = t.split_once(" in ") {
                Req::In(k.trim().to_string(), set_values(rest).ok_or_else(|| bad(t))?)
            } else if let Some((k, v)) = t.split_once("!=") {
                Req::NotEq(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Req::Eq(k.trim().to_string(), v.trim().to_string())
            } else {
                Req::Exists(t.to_string())
            };
            let ok = match &req {
                Req::Eq(k, v) | Req::NotEq(k, v) => valid_key(k) && valid_value(v),
                Req::Exists(k) | Req::NotExists(k) => valid_key(k),
                Req::In(k, vs) | Req::NotIn(k, vs) => valid_key(k) && vs.iter().all(|v| valid_value(v)),
            };
            if !ok {
                return Err(bad(t));
            }
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => get(k) == Some(v.as_str()),
            Req::NotEq(k, v) => get(k) != Some(v.as_str()),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

/// A field selector; only `metadata.name` and `metadata.namespace` are supported (like most resources).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(FieldSelector(reqs));
        }
        for term in s.split(',') {
            let t = term.trim();
            let (k, eq, v) = if let Some((k, v)) = t.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                (k, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{t}'; can't understand '{t}'"
                )));
            };
            let k = k.trim();
            if k != "metadata.name" && k != "metadata.namespace" {
                return Err(ApiError::bad_request(format!("field label not supported: {k}")));
            }
            reqs.push((k.to_string(), eq, v.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(k, eq, v)| {
            let actual = match k.as_str() {
                "metadata.name" => obj.pointer("/metadata/name"),
                _ => obj.pointer("/metadata/namespace"),
            }
            .and_then(Value::as_str)
            .unwrap_or("");
            (actual == v) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selectors() {
        let o = json!({"metadata": {"labels": {"a": "1", "kubernetes.io/service-name": "web"}}});
        for (sel, want) in [
            ("", true),
            ("a=1", true),
            ("a==1", true),
            ("a!=1", false),
            ("a", true),
            ("!a", false),
            ("b", false),
            ("!b", true),
            ("a=1,kubernetes.io/service-name=web", true),
            ("a=1,kubernetes.io/service-name=db", false),
            ("a in (1,2)", true),
            ("a notin (1,2)", false),
            ("b notin (1)", true),
            ("b!=1", true),
        ] {
            assert_eq!(LabelSelector::parse(sel).unwrap().matches(&o), want, "{sel}");
        }
        assert!(LabelSelector::parse("a=(").is_err());
    }

    #[test]
    fn field_selectors() {
        let o = json!({"metadata": {"name": "x", "namespace": "ns"}});
        assert!(FieldSelector::parse("metadata.name=x").unwrap().matches(&o));
        assert!(!FieldSelector::parse("metadata.name=x,metadata.namespace!=ns").unwrap().matches(&o));
        assert_eq!(FieldSelector::parse("spec.foo=1").unwrap_err().code, 400);
    }
}
