"""Services that loop: maintenance (reaper, reconciler) now, the scheduler later."""
