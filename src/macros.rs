//! The crate's macros and the one helper every service shares: a named future around a boxed
//! one, the accessors to a middleware's inner service, and taking the service that was polled
//! ready.

/// Declares `pub struct $name<T>`, a future of `T` that is a boxed future inside, so that a
/// service's `Future` type has a name of its own and the public API never shows
/// `Pin<Box<dyn Future>>` (axum's `opaque_future!` does the same). The box can later give way
/// to a state machine without a breaking release.
macro_rules! response_future {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        pub struct $name<T> {
            inner: std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>,
        }

        impl<T> $name<T> {
            pub(crate) fn new(future: impl std::future::Future<Output = T> + Send + 'static) -> Self {
                $name {
                    inner: Box::pin(future),
                }
            }
        }

        impl<T> std::future::Future for $name<T> {
            type Output = T;

            fn poll(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<T> {
                self.inner.as_mut().poll(cx)
            }
        }

        impl<T> std::fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }
    };
}

pub(crate) use response_future;

/// `get_ref`, `get_mut` and `into_inner` for a middleware whose inner service is the field
/// `$field` (tower-http's `define_inner_service_accessors!`).
macro_rules! inner_service_accessors {
    ($service:ident, $inner:ident, $field:ident) => {
        impl<$inner> $service<$inner> {
            /// The inner service.
            pub fn get_ref(&self) -> &$inner {
                &self.$field
            }

            /// The inner service, mutably.
            pub fn get_mut(&mut self) -> &mut $inner {
                &mut self.$field
            }

            /// The inner service, giving this middleware up.
            pub fn into_inner(self) -> $inner {
                self.$field
            }
        }
    };
}

pub(crate) use inner_service_accessors;

/// Takes the inner service that `poll_ready` was called on, leaving a clone in its place, for a
/// `call` that uses it after an `await`. The clone has not been polled ready; the taken one has
/// (tower-service's "Be careful when cloning inner services").
pub(crate) fn take_ready<S: Clone>(service: &mut S) -> S {
    let clone = service.clone();
    std::mem::replace(service, clone)
}
