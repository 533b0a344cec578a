"""Roles are Django groups (created by a migration): `viewer` reads; `operator` also creates and
controls tasks; `reviewer` also decides review items. Superusers hold every role."""
VIEWER, OPERATOR, REVIEWER = "viewer", "operator", "reviewer"
ROLES = (VIEWER, OPERATOR, REVIEWER)

# Which groups grant a role: operators and reviewers can read too.
GRANTED_BY = {
    VIEWER: {VIEWER, OPERATOR, REVIEWER},
    OPERATOR: {OPERATOR},
    REVIEWER: {REVIEWER},
}


def user_roles(user) -> set[str]:
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return set()
    if user.is_superuser:
        return set(ROLES)
    cached = getattr(user, "_orchestrator_roles", None)
    if cached is None:
        groups = set(user.groups.filter(name__in=ROLES).values_list("name", flat=True))
        cached = {role for role, granting in GRANTED_BY.items() if groups & granting}
        user._orchestrator_roles = cached
    return cached


def has_role(user, role: str) -> bool:
    return role in user_roles(user)


def is_admin(user) -> bool:
    """Admins (superusers) grant what reaches the host: host tools, waived approvals."""
    return bool(getattr(user, "is_authenticated", False) and user.is_active and user.is_superuser)
