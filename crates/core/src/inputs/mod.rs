//! What the inputs mean: [`model`] (a Service and its EndpointSlices, validated; a refusal names
//! the object and the value), [`slim`] (the fields kept), [`compact`] (nodelb's own compact
//! EndpointSlice), [`manifests`] (YAML/JSON text to objects).

pub mod compact;
pub mod manifests;
pub mod model;
pub mod slim;
