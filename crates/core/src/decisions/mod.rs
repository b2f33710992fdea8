//! What to serve, and where: [`pool`] (node port pools: the `NodePortPool` type, selection,
//! overlaps), [`sharing`] (which Services may hold one number together), [`servicelb`] (the
//! k3s ServiceLB label rule), [`port_policy`] (node-port ranges and listeners), [`alloc`]
//! (node-port allocation), [`endpoint_policy`] (which endpoint addresses may be DNATed to),
//! [`desired`] (one sync's whole decision).

pub mod alloc;
pub mod desired;
pub mod endpoint_policy;
pub mod pool;
pub mod port_policy;
pub mod servicelb;
pub mod sharing;
