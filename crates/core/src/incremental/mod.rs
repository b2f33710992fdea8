//! Only what changed, between syncs: [`view`] (what changed in a source's view, by object),
//! [`per_object`] (values kept per unchanged object), [`model_cache`] (each Service's model kept
//! while its objects are the same), [`replan`] (the ruleset patched per changed Service).

pub mod model_cache;
pub mod per_object;
pub mod replan;
pub mod view;
