"""The admin's model profiles (ModelProfile; orchestrator/llm/profiles.py resolves them).

A profile's key is a secret: the form takes a new one in a password field that never shows
the stored value (empty keeps it, "Remove the key" clears it), the lists show only whether
one is set and its last four characters when it is long enough for that to give nothing
away, and the audit entry of a save names the profile, never the key. A name LLM_MODELS
declares is refused: the environment's profile wins, so this one would never be used."""
from django import forms
from django.contrib import admin

from .admin_guards import AdminsOnly
from .engine.audit import audit
from .llm import profiles
from .models import ModelProfile

KEY_HINT_MIN_LENGTH = 16  # shorter keys show no characters at all


def key_hint(key: str) -> str:
    if not key:
        return "—"
    return f"set (…{key[-4:]})" if len(key) >= KEY_HINT_MIN_LENGTH else "set"


class ModelProfileForm(forms.ModelForm):
    api_key = forms.CharField(
        required=False, strip=True, widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
        help_text="A secret: never shown again, logged or exported. Leave empty to keep the current key.")
    clear_api_key = forms.BooleanField(required=False, label="Remove the key")

    class Meta:
        model = ModelProfile
        fields = "__all__"

    def clean_name(self):
        name = self.cleaned_data["name"]
        if not profiles.NAME_PATTERN.match(name):
            raise forms.ValidationError("Letters, digits, '.', '_' or '-' only (a task names it in `model`).")
        try:
            declared = profiles.declared()
        except profiles.ModelsConfigError:
            declared = {}
        if name in declared:
            raise forms.ValidationError(f"LLM_MODELS declares a profile named {name!r}; the environment's wins, so "
                                        f"this one would never be used. Pick another name.")
        return name

    def clean(self):
        data = super().clean()
        if data.get("clear_api_key"):
            data["api_key"] = ""
        elif not data.get("api_key") and self.instance.pk:
            data["api_key"] = self.instance.api_key  # the stored key, kept (the field never shows it)
        return data


@admin.register(ModelProfile)
class ModelProfileAdmin(AdminsOnly, admin.ModelAdmin):
    """Model servers an agent task may pick with `model` (besides LLM_MODELS' and the default).
    Admins only: a staff user who could change `base_url` would have the stored key sent to a
    server of their choosing."""

    form = ModelProfileForm
    list_display = ("name", "model", "base_url", "key", "context_window", "price_input_per_million",
                    "price_output_per_million", "price_cached_per_million", "supports_tools",
                    "supports_stream_options", "send_reasoning_back", "enabled", "updated_at")
    list_filter = ("enabled", "supports_tools", "supports_stream_options", "created_at")
    search_fields = ("name", "model", "base_url")
    date_hierarchy = "created_at"
    readonly_fields = ("key", "created_at", "updated_at")
    fields = ("name", "enabled", "base_url", "model", "key", "api_key", "clear_api_key", "context_window",
              "price_input_per_million", "price_output_per_million", "price_cached_per_million", "supports_tools",
              "supports_stream_options", "send_reasoning_back", "created_at", "updated_at")

    @admin.display(description="API key")
    def key(self, obj):
        return key_hint(obj.api_key if obj else "")

    def save_model(self, request, obj, form, change):
        before = ModelProfile.objects.filter(pk=obj.pk).values_list("api_key", flat=True).first() if obj.pk else None
        super().save_model(request, obj, form, change)
        audit(action="model_profile.save", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              after={"name": obj.name, "base_url": obj.base_url, "model": obj.model, "enabled": obj.enabled,
                     "key_set": bool(obj.api_key), "key_changed": before != obj.api_key})
