//! Only what changed, between syncs: [`view`] (what changed in a source's view, by object),
//! [`book`] (each Service's node ports as last decided, and the scope a change must decide),
//! [`per_object`] (values kept per unchanged object), [`model_cache`] (each Service's model kept
//! while its objects are the same), [`replan`] (the ruleset patched per changed Service).

pub mod book;
pub mod model_cache;
pub mod per_object;
pub mod replan;
pub mod view;
